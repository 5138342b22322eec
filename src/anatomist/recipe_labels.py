"""How a recipe is named where several are shown together: by the settings in which they differ.

A plan's Pareto front, a report of two estimates, a bench suite: each recipe is one row or one point,
and a reader must tell them apart. Two recipes that differ only in Liger Kernel were both "bs2 gc";
here each recipe's label and each table's columns are the facets (method, batch, checkpointing,
precision, optimizer, compile, sharding, Liger, Cut Cross-Entropy, attention, trainer) whose values
differ among the recipes shown, so what sets them apart is always said. The CLI's tables, the
report's charts and tables, and the page read this one table of facets.

A facet's value comes from the axis that owns it (`precision_of`, `sharding_of`, `method_of`), so a
label says what the plan and the estimate call the same setting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from anatomist.plan.space import method_of
from anatomist.recipe import Recipe
from anatomist.recipe.axis_values import precision_of, sharding_of


def _on(value: bool) -> str:
    return "on" if value else "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class Facet:
    """One setting a recipe is told apart by."""

    key: str
    """Its id (a table's `data-key`, the page's column)."""
    header: str
    """The column's name in a table."""
    value: Callable[[Recipe, int], str]
    """Its value for a recipe on that many GPUs, as a table cell says it."""
    short: Callable[[str], str]
    """How a label says that value ("Liger", "no Liger")."""
    said: Callable[[str], str] | None = None
    """How a recipe's one-line summary says that value ("Liger on"); None: not in the summary."""


TRAINER_NAMES = {"trainer": "Trainer", "sft": "TRL's SFTTrainer", "dpo": "TRL's DPOTrainer"}

FACETS: tuple[Facet, ...] = (
    Facet(key="method", header="method", value=lambda r, n: method_of(r),
          short=lambda v: {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}.get(v, v),
          said=lambda v: f"{ {'lora': 'LoRA', 'qlora': 'QLoRA'}.get(v, v)} fine-tuning"),
    Facet(key="batch", header="batch x accum",
          value=lambda r, n: f"{r.per_device_train_batch_size} x {r.gradient_accumulation_steps}",
          short=lambda v: "bs" + v.removesuffix(" x 1").replace(" x ", " x"), said=lambda v: f"batch {v}"),
    Facet(key="checkpointing", header="ckpt", value=lambda r, n: r.checkpointing,
          short=lambda v: "no ckpt" if v == "off" else "ckpt" if v == "on" else f"ckpt {v}",
          said=lambda v: f"checkpointing {v}"),
    Facet(key="precision", header="precision", value=lambda r, n: precision_of(r), short=lambda v: v, said=lambda v: v),
    Facet(key="optim", header="optim", value=lambda r, n: r.optim, short=lambda v: v, said=lambda v: v),
    Facet(key="compile", header="compile", value=lambda r, n: _on(r.torch_compile),
          short=lambda v: "compile" if v == "on" else "no compile", said=lambda v: f"compile {v}"),
    Facet(key="sharding", header="sharding", value=sharding_of, short=lambda v: v, said=lambda v: f"sharding {v}"),
    Facet(key="liger", header="Liger", value=lambda r, n: _on(r.use_liger_kernel),
          short=lambda v: "Liger" if v == "on" else "no Liger", said=lambda v: f"Liger Kernel {v}"),
    Facet(key="cce", header="Cut CE", value=lambda r, n: _on(r.cut_cross_entropy),
          short=lambda v: "Cut CE" if v == "on" else "no Cut CE", said=lambda v: f"Cut Cross-Entropy {v}"),
    Facet(key="attention", header="attention", value=lambda r, n: r.attn_implementation or "default", short=lambda v: v,
          said=lambda v: f"attention {v}"),
    Facet(key="trainer", header="trainer", value=lambda r, n: r.trainer, short=lambda v: TRAINER_NAMES.get(v, v),
          said=lambda v: TRAINER_NAMES.get(v, v)),
    Facet(key="workers", header="workers", value=lambda r, n: str(r.dataloader_num_workers),
          short=lambda v: f"{v} workers"),
    Facet(key="pin_memory", header="pin memory", value=lambda r, n: _on(r.dataloader_pin_memory),
          short=lambda v: "pin" if v == "on" else "no pin"),
)
FACET_KEYS: tuple[str, ...] = tuple(f.key for f in FACETS)
ALWAYS = ("batch",)
"""Facets every label and table has, differing or not: a reader always wants the batch."""


def differing(recipes: Sequence[Recipe], num_gpus: int | Sequence[int] = 1, *,
              always: Sequence[str] = ALWAYS) -> list[Facet]:
    """The facets whose values differ among `recipes` (and those of `always`), in FACETS order; `num_gpus`: the
    GPUs of all, or of each recipe. A single recipe is compared with the defaults (Recipe(), its attention SDPA), so
    its label names what it switches on."""
    if not recipes:
        return []
    sizes = [num_gpus] * len(recipes) if isinstance(num_gpus, int) else list(num_gpus)
    pairs = list(zip(recipes, sizes, strict=True))
    if len(pairs) == 1:  # SDPA, transformers' pick for most models, is not named either
        default = Recipe(attn_implementation="sdpa" if recipes[0].attn_implementation == "sdpa" else None)
        pairs.append((default, sizes[0]))
    return [f for f in FACETS if f.key in always or len({f.value(r, n) for r, n in pairs}) > 1]


def label(recipe: Recipe, facets: Sequence[Facet], num_gpus: int = 1) -> str:
    """`recipe` named by `facets` ("bs2, Liger, compile")."""
    return ", ".join(f.short(f.value(recipe, num_gpus)) for f in facets)


def labels(recipes: Sequence[Recipe], num_gpus: int = 1) -> list[str]:
    """Each recipe named by what sets it apart from the others (`differing`)."""
    facets = differing(recipes, num_gpus)
    return [label(r, facets, num_gpus) for r in recipes]


def summary(recipe: Recipe, num_gpus: int = 1, facets: Sequence[Facet] = FACETS) -> str:
    """One line naming each of `facets` of `recipe` that has a `said` ("full fine-tuning, batch 2 x 8, checkpointing
    on, bf16, adamw_torch_fused, compile off, sharding none, Liger Kernel on, ..."): the plan's top pick as the
    CLI and the page say it."""
    return ", ".join(f.said(f.value(recipe, num_gpus)) for f in facets if f.said is not None)


def shared(recipes: Sequence[Recipe], num_gpus: int | Sequence[int] = 1) -> str:
    """What `recipes` (two or more) all have in common, said as `summary` says it: the line under a table whose
    columns are only what differs, so that nothing the recipes share (Liger on for all) goes unsaid."""
    if len(recipes) < 2:
        return ""
    same = [f for f in FACETS if f not in differing(recipes, num_gpus)]
    return summary(recipes[0], num_gpus if isinstance(num_gpus, int) else num_gpus[0], same)


def recipe_from_dict(data: dict[str, Any]) -> Recipe | None:
    """The Recipe a result file's recipe object describes (its own keys, as `--json` writes them), or None where
    it is not one this version reads (an older or foreign file): its label then falls back to its name."""
    known = {k: v for k, v in data.items() if k in Recipe.__dataclass_fields__}
    try:
        return Recipe(**known)
    except (TypeError, ValueError):  # InputError is a ValueError
        return None
