"""What a report is about: model, parameters, sequence length, batch, recipe and GPU.

The page header shows it for all the inputs together (`describe`); each chart that compares
several results says it in its title (`subtitle`) and, where results differ in model, GPU or
sequence length, next to each result (`distinguishing`), so a chart saved alone as PNG still
says what it shows. Values the input does not carry are said to be missing, never guessed.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from anatomist.recipe_labels import differing, label, recipe_from_dict
from anatomist.report.load import RecipeResult, ReportData

MISSING = "not in the input"
T = TypeVar("T")
SUBTITLE_CHARS = 110
"""A chart subtitle longer than this is shortened (the header above the chart has everything)."""


@dataclass(kw_only=True, slots=True)
class Field:
    """One line of the header: its key (the `data-key` in the HTML), label and the text shown."""

    key: str
    label: str
    text: str


def describe(data: ReportData) -> list[Field]:
    """The header's lines for everything in `data`, each value listed once in input order."""
    results = data.results
    gpus = _distinct(r.gpu_name for r in results)
    if data.profile_device and data.profile_device not in gpus:
        gpus.append(f"{data.profile_device} (profile)")
    name = distinguishing(results)
    labels = _distinct(name(r) for r in results)
    recipes = (labels[0] if len(labels) == 1 else f"{len(labels)} recipes: {'; '.join(labels)}") if labels else MISSING
    return [
        Field(key="model", label="Model", text=_listed(_distinct(r.model for r in results if r.model != "?"))),
        Field(key="parameters", label="Parameters",
              text=_partly([r.parameters for r in results], format_parameters)),
        Field(key="seq_len", label="Sequence length", text=_partly([r.seq_len for r in results], str)),
        Field(key="batch", label="Batch", text=_batches(results)),
        Field(key="recipe", label="Recipe", text=recipes),
        Field(key="gpu", label="GPU", text=_listed(gpus)),
    ]


def subtitle(results: list[RecipeResult]) -> str:
    """The line under a chart's title: "bert-large-uncased (335.1 M parameters), seq 512, on V100-16GB";
    where the results differ, the values side by side ("on V100-16GB vs A100-80GB")."""
    models = _distinct(r.model for r in results)
    parameters = _distinct(r.parameters for r in results)
    seq_lens = _distinct(r.seq_len for r in results)
    gpus = _distinct(r.gpu_name for r in results)
    model = " vs ".join(models) or "model not given"
    if len(models) == 1 and len(parameters) == 1:
        model += f" ({format_parameters(parameters[0])} parameters)"
    parts = [model]
    if seq_lens:
        parts.append("seq " + " vs ".join(str(s) for s in seq_lens))
    parts.append("on " + (" vs ".join(gpus) or "GPU not given"))
    return textwrap.shorten(", ".join(parts), SUBTITLE_CHARS, placeholder=" ...")


def distinguishing(results: list[RecipeResult]) -> Callable[[RecipeResult], str]:
    """A function naming each result among the others drawn with it: a bench row by its name, an estimate or a
    plan entry by the recipe settings in which they differ (`recipe_labels.differing`: "bs2, Liger" beside "bs2,
    no Liger"), and each by the model, GPU or sequence length where those differ ("bs4 (gpt2, A100-80GB)")."""
    parsed = {id(r): recipe for r in results if not r.named and r.recipe
              and (recipe := recipe_from_dict(r.recipe)) is not None}
    known = [(r, parsed[id(r)]) for r in results if id(r) in parsed]
    facets = differing([recipe for _, recipe in known], [r.num_gpus for r, _ in known])
    attributes: list[Callable[[RecipeResult], object]] = [lambda r: r.model, lambda r: r.gpu_name,
                                                           lambda r: r.seq_len and f"seq {r.seq_len}"]
    differ = [a for a in attributes if len({a(r) for r in results}) > 1]

    def name(result: RecipeResult) -> str:
        recipe = parsed.get(id(result))
        base = label(recipe, facets, result.num_gpus) if recipe is not None else result.label
        extra = [str(a(result)) for a in differ if a(result)]
        return base + (f" ({', '.join(extra)})" if extra else "") + (" (top pick)" if result.best else "")

    return name


def format_parameters(count: int) -> str:
    """335143938 -> "335.1 M", 8030261248 -> "8.03 B" (the CLI's style)."""
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M"


def _batches(results: list[RecipeResult]) -> str:
    """"4, 8 per device x 1 accumulation step(s)" over the results that carry a recipe."""
    with_recipe = [r.recipe for r in results if r.recipe]
    if not with_recipe:
        return MISSING
    per_device = _distinct(str(r.get("per_device_train_batch_size", "?")) for r in with_recipe)
    accumulation = _distinct(str(r.get("gradient_accumulation_steps", 1)) for r in with_recipe)
    return f"{', '.join(per_device)} per device x {', '.join(accumulation)} accumulation step(s)"


def _partly(values: list[int | None], fmt: Callable[[int], str]) -> str:
    """The distinct known values, and how many results do not say (bench rows carry no parameter count)."""
    known = _distinct(values)
    if not known:
        return MISSING
    unknown = sum(v is None for v in values)
    return _listed([fmt(v) for v in known]) + (f" ({MISSING} for {unknown} of {len(values)} results)" if unknown else "")


def _distinct(values: Iterable[T | None]) -> list[T]:
    out: list[T] = []
    for v in values:
        if v is not None and v not in out:
            out.append(v)
    return out


def _listed(values: list[str]) -> str:
    return "; ".join(values) if values else MISSING
