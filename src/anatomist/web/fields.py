"""The page's fields, in the page's order: the question asked first (model, GPU, method, trainer, length, batch,
GPUs, nodes), then every other option of `anatomist estimate` and `anatomist plan`, grouped as their `--help`
groups them. Recipe fields come from the dataclass (name, Literal choices, help, default), as the CLI's flags do.
"""

from __future__ import annotations

import functools
from typing import Any, cast, get_args

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.web.form import QUESTION, VIEWS, Field, Kind
from anatomist.web.labels import choice_labels, field_label

ESTIMATE, PLAN = ("estimate",), ("plan",)
DATA, GPUS, SEARCH, TRAINER, LORA = ("model and data", "GPUs and memory", "what the plan searches",
                                     "the trainer (kept as given, not searched)",
                                     "parameter-efficient fine-tuning (LoRA, QLoRA)")
"""The titles of the groups under "advanced" that are not the recipe's own."""

RECIPE_BOUNDS: dict[str, tuple[float | None, float | None, bool]] = {
    "per_device_train_batch_size": (1, None, False), "gradient_accumulation_steps": (1, None, False),
    "checkpoint_every": (1, None, False), "dataloader_num_workers": (0, None, False), "lora_r": (1, None, False),
    "lora_alpha": (1, None, False), "lora_dropout": (0, 1, True), "max_grad_norm": (0, None, False),
}
"""(minimum, maximum, the maximum refused) of the Recipe fields Recipe checks so: the page names the limit as the
value is given (an int's maximum is INT_MAX)."""


@functools.cache
def fields() -> tuple[Field, ...]:
    """The page's fields, in the page's order (module docstring)."""
    from anatomist.cli.recipe_flags import recipe_groups
    from anatomist.cli.requests import LORA_FIELDS

    out = [*_question(), *_data(), *_devices(), *_search()]
    out += [_recipe_field(name, LORA, views=PLAN) for name in LORA_FIELDS]
    asked = {f.name for f in out if f.group == QUESTION}
    for title, group in recipe_groups():
        out += [_recipe_field(f.name, title) for f in group if f.name not in asked]
    return tuple(out)


def _field(name: str, flag: str | None, kind: str, group: str, help: str, *, views: tuple[str, ...] = VIEWS,
           choices: tuple[Any, ...] | None = None, default: Any = None, minimum: float | None = None,
           maximum: float | None = None, below_maximum: bool = False, label: str | None = None) -> Field:
    return Field(name=name, flag=flag, kind=cast(Kind, kind), help=help, label=label or field_label(name), group=group,
                 choices=choices, choice_labels=choice_labels(name, choices), default=default, views=views,
                 minimum=minimum, maximum=maximum, below_maximum=below_maximum)


def _recipe_field(name: str, group: str, views: tuple[str, ...] = ESTIMATE) -> Field:
    """The field of the Recipe field `name`: its flag, kind, choices, help and default are the dataclass's."""
    from anatomist.cli.recipe_flags import flag_name
    from anatomist.recipe import field_kinds
    from anatomist.recipe.help import FIELD_HELP

    kind = field_kinds()[name]
    web_kind = "bool" if kind.type is bool else "choice" if kind.choices is not None else kind.type.__name__
    low, high, below = RECIPE_BOUNDS.get(name, (None, None, False))
    return _field(name, flag_name(name), web_kind, group, FIELD_HELP[name].text, views=views, choices=kind.choices,
                  default=_recipe_defaults()[name], minimum=low, maximum=high, below_maximum=below)


@functools.cache
def _recipe_defaults() -> dict[str, Any]:
    from anatomist.recipe import Recipe

    return Recipe().to_dict()


def _question() -> list[Field]:
    """What the page asks first: model, GPU, method, trainer, length, batch, GPUs, nodes."""
    from anatomist.cli.estimate import DEFAULT_GPU, DEFAULT_MODEL

    return [
        _field("model", None, "str", QUESTION, default=DEFAULT_MODEL,
               help="A catalog name (anatomist models), a name people type for one (an instruct or re-uploaded "
                    "variant), or a Hub id; or upload the model's config.json."),
        _field("config", None, "upload", QUESTION,
               help="The model's config.json: read as JSON, never executed; a model that needs its own code is refused."),
        _field("gpu", "--gpu", "str", QUESTION, default=DEFAULT_GPU,
               help="Target GPU: a catalog name or as people write it (4090, a100 80gb, H100)."),
        _recipe_field("peft", QUESTION),
        _field("peft", "--peft", "multi", QUESTION, views=PLAN, choices=("lora", "qlora"),
               label="Methods: full fine-tuning, and also",
               help="Full fine-tuning is always searched; tick LoRA (bf16/fp32 base) or QLoRA (4-bit NF4 base) to "
                    "search them too: they change what is trained."),
        _recipe_field("trainer", QUESTION, views=VIEWS),
        _field("seq_len", "--seq-len", "int", QUESTION, default=512, minimum=1,
               help="Tokens per sample (512, or the model's maximum if lower)."),
        _recipe_field("per_device_train_batch_size", QUESTION),
        _field("global_batch_size", "--global-batch-size", "int", QUESTION, views=PLAN, minimum=1,
               help="Samples per optimizer step over all GPUs (empty: any batch, no accumulation)."),
        _field("gpus", "--gpus", "int", QUESTION, default=1, minimum=1,
               help="Data-parallel GPUs on each node (ZeRO and FSDP shard across all of them)."),
        _field("nodes", "--nodes", "int", QUESTION, default=1, minimum=1,
               help="Machines the GPUs are spread over (each with the GPUs above)."),
    ]


def _data() -> list[Field]:
    """The data and the model's head."""
    from anatomist.model_facts import TASKS

    return [
        _field("task", "--task", "choice", DATA, choices=TASKS,
               help="The head trained (default: sequence classification for encoders, causal LM for decoders)."),
        _field("recipe", None, "upload", DATA,
               help="Your TrainingArguments, TRL (trl sft --config), accelerate or DeepSpeed file, JSON or YAML, as "
                    "--recipe reads it: for an estimate the fields here override it; for a plan what it sets is held "
                    "fixed and the rest searched."),
        _field("avg_seq_len", "--avg-seq-len", "int", DATA, minimum=1,
               help="Mean tokens per example (at most the sequence length): what padding-free training and packing "
                    "process."),
        _field("lengths", None, "upload", DATA,
               help="The token count of every example: one integer per line, or a JSON list (instead of the average)."),
        _field("prompt_len", "--prompt-len", "int", DATA, minimum=0,
               help="DPO: tokens of each prompt, which the loss does not score (default 0: every token)."),
        _field("mode", "--mode", "choice", DATA, views=ESTIMATE, choices=("train", "inference"), default="train",
               help="A training step, or a forward pass only."),
        _field("longest_seq_len", "--longest-seq-len", "flag", DATA, views=ESTIMATE,
               help="Estimate at the longest sequence that fits (multiples of 128 tokens up to the model's longest), "
                    "searched at the batch given; the sequence length field is then not read."),
    ]


def _devices() -> list[Field]:
    """The network between the nodes, the memory kept free, the cluster sizes a plan chooses among."""
    from anatomist.estimate.time.network import default_network, networks

    return [
        _field("network", "--network", "choice", GPUS, choices=tuple(networks()), default=default_network(),
               help="The network between the nodes (only the time changes)."),
        _field("memory_margin", "--memory-margin", "float", GPUS, default=DEFAULT_MEMORY_MARGIN, minimum=0, maximum=1,
               below_maximum=True, help="Share of the GPU's memory kept free when deciding what fits."),
        _field("max_nodes", "--max-nodes", "int", GPUS, views=PLAN, minimum=1,
               help="Plan 1, 2, 4 ... GPUs on one node, then 2 ... N whole nodes, and pick the size with the most "
                    "samples/s per GPU (leave Nodes empty)."),
    ]


def _search() -> list[Field]:
    """What the plan searches, and the trainer settings it keeps as given."""
    from anatomist.axes.optimizers import DEFAULT_SEARCH, OPTIMIZERS
    from anatomist.axes.precisions import FULL_PRECISIONS
    from anatomist.axes.shardings import SHARDING_NAMES
    from anatomist.plan.candidates import Objective

    return [
        _field("objective", "--objective", "choice", SEARCH, views=PLAN, choices=get_args(Objective),
               default="throughput", help="The top pick: the fastest that fits, or the smallest."),
        _field("optims", "--optims", "multi", SEARCH, views=PLAN, choices=tuple(OPTIMIZERS), default=list(DEFAULT_SEARCH),
               help="Optimizers searched."),
        _field("precisions", "--precisions", "multi", SEARCH, views=PLAN, choices=FULL_PRECISIONS,
               help="Precisions searched (none ticked: all the GPU supports)."),
        _field("shardings", "--shardings", "multi", SEARCH, views=PLAN, choices=SHARDING_NAMES,
               help="Sharding options searched, each where it runs (none ticked: all those of the GPU count)."),
        _field("no_compile", "--no-compile", "flag", SEARCH, views=PLAN, help="Do not consider torch.compile."),
        _field("no_liger_kernel", "--no-liger-kernel", "flag", SEARCH, views=PLAN,
               help="Do not consider Liger Kernel (searched by default for the causal LMs whose kernels anatomist "
                    "traces)."),
        _field("no_tensor_parallel", "--no-tensor-parallel", "flag", SEARCH, views=PLAN,
               help="Do not try tensor or expert parallel (tried on more GPUs than one where the recipes without "
                    "them do not fit; only the Trainer's files can say them)."),
        _field("precompute_ref_log_probs", "--precompute-ref-log-probs", "flag", TRAINER, views=PLAN,
               help="DPO: reference log-probabilities computed before training (no reference model held)."),
        _field("padding_free", "--padding-free", "flag", TRAINER, views=PLAN,
               help="SFT: padding-free micro-batches (needs the data's lengths; flash_attention_2 searched only)."),
    ]
