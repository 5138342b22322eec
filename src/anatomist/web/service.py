"""Every call the page makes into anatomist, in one place.

The page asks what `anatomist estimate` and `anatomist plan` answer, so a request becomes their
command line (`form.flags`), is read by the CLI's own parser (`cli.build_parser`) and goes through
the CLI's own `build_estimate` / `build_plan`: the page, the CLI and a link's "same as" command
agree by construction. The rest is the report's charts (`report.load`, `report.charts`) and the
files `plan.emit.write` writes. Only this module imports the library's computing parts; when the
library changes, this is the file to adapt.

What the page may not do that the CLI may: name a path on the server (a model or a file a recipe
file refers to; upload the file instead), run a model's own code (`--trust-remote-code` is never
passed), reach the Hub unless the server was started with `--allow-network`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import shlex
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast, get_args

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN, MemoryCategory
from anatomist.errors import InputError
from anatomist.web import capture
from anatomist.web.form import QUESTION, VIEWS, Field, Form, Kind, flags
from anatomist.web.labels import choice_labels, field_label
from anatomist.web.uploads import Upload, UploadStore

Progress = Callable[[int, int], None]
"""Called with (step parts traced, step parts to trace) while a cold trace runs."""

EMIT_FILES = {"trainer": "training_args.json", "accelerate": "accelerate_config.yaml", "deepspeed": "ds_config.json",
              "trl": "sft.yaml"}
"""The file each `plan --emit` target is written to (the trainer snippet names ds_config.json)."""
CHARTS = ("memory", "throughput")
FILE_REFERENCES = ("deepspeed", "fsdp_config", "deepspeed_config_file")
"""Keys whose string value makes a recipe file read another file (recipe_files: referenced_file)."""
CLI_ADVICE = {
    "rerun with --trust-remote-code if you trust it":
        "the page never runs a model's own code (anatomist estimate --trust-remote-code does, on your machine)",
    "(pass --allow-network to ask the Hub)": "(this server does not ask the Hub: upload the model's config.json)",
}
"""The CLI's advice that the page cannot follow, and what to say instead."""

_chart_lock = threading.Lock()  # the charts set matplotlib's global rcParams while they draw


def warm_up() -> None:
    """Import what an estimate and a plan need (torch, transformers, the estimator, the charts) and read
    TrainingArguments' defaults, so that the first request pays none of it."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import anatomist.estimate.predict  # noqa: F401
    import anatomist.plan.emit  # noqa: F401
    import anatomist.plan.search  # noqa: F401
    import anatomist.recipe_files  # noqa: F401
    import anatomist.report.charts  # noqa: F401

    fields()


RECIPE_BOUNDS: dict[str, tuple[float | None, float | None, bool]] = {
    "per_device_train_batch_size": (1, None, False), "gradient_accumulation_steps": (1, None, False),
    "checkpoint_every": (1, None, False), "dataloader_num_workers": (0, None, False), "lora_r": (1, None, False),
    "lora_alpha": (1, None, False), "lora_dropout": (0, 1, True), "max_grad_norm": (0, None, False),
}
"""(minimum, maximum, the maximum refused) of the Recipe fields Recipe checks so: the page names the limit as the
value is given (an int's maximum is INT_MAX)."""


@functools.cache
def fields() -> tuple[Field, ...]:
    """The page's fields, in the page's order: the question asked first (model, GPU, method, trainer, length, batch,
    GPUs, nodes), then every other option of `anatomist estimate` and `anatomist plan`, grouped as their `--help`
    groups them. Recipe fields come from the dataclass (name, Literal choices, help, default), as the CLI's flags."""
    from anatomist.axes.optimizers import DEFAULT_SEARCH, OPTIMIZERS
    from anatomist.axes.precisions import FULL_PRECISIONS
    from anatomist.axes.shardings import SHARDING_NAMES
    from anatomist.cli.estimate import DEFAULT_GPU, DEFAULT_MODEL
    from anatomist.cli.recipe_flags import flag_name, recipe_groups
    from anatomist.estimate.time.network import default_network, networks
    from anatomist.plan.candidates import Objective
    from anatomist.recipe import Recipe, field_kinds
    from anatomist.workload import TASKS

    est, plan, both = ("estimate",), ("plan",), VIEWS
    kinds, defaults = field_kinds(), Recipe().to_dict()
    by_name = {f.name: f for f in dataclasses.fields(Recipe)}

    def field(name: str, flag: str | None, kind: str, group: str, help: str, *, views: tuple[str, ...] = both,
              choices: tuple[Any, ...] | None = None, default: Any = None, minimum: float | None = None,
              maximum: float | None = None, below_maximum: bool = False, label: str | None = None) -> Field:
        return Field(name=name, flag=flag, kind=cast(Kind, kind), help=help, label=label or field_label(name), group=group,
                     choices=choices, choice_labels=choice_labels(name, choices), default=default, views=views,
                     minimum=minimum, maximum=maximum, below_maximum=below_maximum)

    def recipe_field(name: str, group: str, views: tuple[str, ...] = est) -> Field:
        kind = kinds[name]
        web_kind = "bool" if kind.type is bool else "choice" if kind.choices is not None else kind.type.__name__
        low, high, below = RECIPE_BOUNDS.get(name, (None, None, False))
        return field(name, flag_name(name), web_kind, group, by_name[name].metadata["help"], views=views,
                     choices=kind.choices, default=defaults[name], minimum=low, maximum=high, below_maximum=below)

    data, gpus, search, trainer, lora = ("model and data", "GPUs and memory", "what the plan searches",
                                         "the trainer (kept as given, not searched)",
                                         "parameter-efficient fine-tuning (LoRA, QLoRA)")
    out = [
        field("model", None, "str", QUESTION, default=DEFAULT_MODEL,
              help="A catalog name (anatomist models), a name people type for one (an instruct or re-uploaded "
                   "variant), or a Hub id; or upload the model's config.json."),
        field("config", None, "upload", QUESTION,
              help="The model's config.json: read as JSON, never executed; a model that needs its own code is refused."),
        field("gpu", "--gpu", "str", QUESTION, default=DEFAULT_GPU,
              help="Target GPU: a catalog name or as people write it (4090, a100 80gb, H100)."),
        recipe_field("peft", QUESTION),
        field("peft", "--peft", "multi", QUESTION, views=plan, choices=("lora", "qlora"),
              label="Methods: full fine-tuning, and also",
              help="Full fine-tuning is always searched; tick LoRA (bf16/fp32 base) or QLoRA (4-bit NF4 base) to "
                   "search them too: they change what is trained."),
        recipe_field("trainer", QUESTION, views=both),
        field("seq_len", "--seq-len", "int", QUESTION, default=512, minimum=1,
              help="Tokens per sample (512, or the model's maximum if lower)."),
        recipe_field("per_device_train_batch_size", QUESTION),
        field("global_batch_size", "--global-batch-size", "int", QUESTION, views=plan, minimum=1,
              help="Samples per optimizer step over all GPUs (empty: any batch, no accumulation)."),
        field("gpus", "--gpus", "int", QUESTION, default=1, minimum=1,
              help="Data-parallel GPUs on each node (ZeRO and FSDP shard across all of them)."),
        field("nodes", "--nodes", "int", QUESTION, default=1, minimum=1,
              help="Machines the GPUs are spread over (each with the GPUs above)."),
        # the data and the model's head
        field("task", "--task", "choice", data, choices=TASKS,
              help="The head trained (default: sequence classification for encoders, causal LM for decoders)."),
        field("recipe", None, "upload", data,
              help="Your TrainingArguments, TRL (trl sft --config), accelerate or DeepSpeed file, JSON or YAML, as "
                   "--recipe reads it: for an estimate the fields here override it; for a plan what it sets is held "
                   "fixed and the rest searched."),
        field("avg_seq_len", "--avg-seq-len", "int", data, minimum=1,
              help="Mean tokens per example (at most the sequence length): what padding-free training and packing "
                   "process."),
        field("lengths", None, "upload", data,
              help="The token count of every example: one integer per line, or a JSON list (instead of the average)."),
        field("prompt_len", "--prompt-len", "int", data, minimum=0,
              help="DPO: tokens of each prompt, which the loss does not score (default 0: every token)."),
        field("mode", "--mode", "choice", data, views=est, choices=("train", "inference"), default="train",
              help="A training step, or a forward pass only."),
        # the devices
        field("network", "--network", "choice", gpus, choices=tuple(networks()), default=default_network(),
              help="The network between the nodes (only the time changes)."),
        field("memory_margin", "--memory-margin", "float", gpus, default=DEFAULT_MEMORY_MARGIN, minimum=0, maximum=1,
              below_maximum=True, help="Share of the GPU's memory kept free when deciding what fits."),
        field("max_nodes", "--max-nodes", "int", gpus, views=plan, minimum=1,
              help="Plan 1, 2, 4 ... GPUs on one node, then 2 ... N whole nodes, and pick the size with the most "
                   "samples/s per GPU (leave Nodes empty)."),
        # the plan's search
        field("objective", "--objective", "choice", search, views=plan, choices=get_args(Objective),
              default="throughput", help="The top pick: the fastest that fits, or the smallest."),
        field("optims", "--optims", "multi", search, views=plan, choices=tuple(OPTIMIZERS), default=list(DEFAULT_SEARCH),
              help="Optimizers searched."),
        field("precisions", "--precisions", "multi", search, views=plan, choices=FULL_PRECISIONS,
              help="Precisions searched (none ticked: all the GPU supports)."),
        field("shardings", "--shardings", "multi", search, views=plan, choices=SHARDING_NAMES,
              help="Sharding options searched, each where it runs (none ticked: all those of the GPU count)."),
        field("no_compile", "--no-compile", "flag", search, views=plan, help="Do not consider torch.compile."),
        field("no_liger_kernel", "--no-liger-kernel", "flag", search, views=plan,
              help="Do not consider Liger Kernel (searched by default for the causal LMs whose kernels anatomist "
                   "traces)."),
        field("precompute_ref_log_probs", "--precompute-ref-log-probs", "flag", trainer, views=plan,
              help="DPO: reference log-probabilities computed before training (no reference model held)."),
        field("padding_free", "--padding-free", "flag", trainer, views=plan,
              help="SFT: padding-free micro-batches (needs the data's lengths; flash_attention_2 searched only)."),
    ]
    for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
        out.append(recipe_field(name, lora, views=plan))
    asked = {f.name for f in out if f.group == QUESTION}
    for title, group in recipe_groups():
        out += [recipe_field(f.name, title) for f in group if f.name not in asked]
    return tuple(out)


def schema(*, allow_network: bool) -> dict[str, Any]:
    """What the page builds its form from: the fields, the model and GPU catalogs, the memory categories."""
    from anatomist.hardware import catalog
    from anatomist.plan.emit import TARGETS
    from anatomist.report.charts import CATEGORY_COLOURS
    from anatomist.web.uploads import MAX_UPLOAD_BYTES

    return {
        "fields": [f.to_dict() for f in fields()],
        "models": model_choices(),
        "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes, "aliases": list(g.aliases)}
                 for g in catalog().values()],
        "categories": [{"key": c.value, "label": c.label, "description": c.description, "colour": CATEGORY_COLOURS[c]}
                       for c in MemoryCategory],
        "targets": [{"name": t, "file": EMIT_FILES[t]} for t in TARGETS],
        "allow_network": allow_network,
        "max_upload_bytes": MAX_UPLOAD_BYTES,
    }


def model_choices() -> list[dict[str, Any]]:
    """The names the model field suggests as one types: every catalog entry (`catalog_entries`), then every name
    the catalog's alias table resolves (an instruct or re-uploaded variant: `catalog_aliases`, where this version's
    catalog has one), each with what it is; whatever those listings return, nothing typed in here."""
    from anatomist import model_catalog

    entries = {name: model_catalog.summarize(e) for name, e in model_catalog.catalog_entries().items()}
    out = [{"name": m.name, "hub_id": m.hub_id, "family": m.family, "parameters": m.parameters,
            "about": f"{m.family}, {m.parameters / 1e9:.2f}B parameters ({m.hub_id})"} for m in entries.values()]
    aliases = getattr(model_catalog, "catalog_aliases", None)
    for alias in (aliases() if aliases is not None else {}).values():
        entry = entries.get(alias.config)
        if entry is None:
            continue
        out.append({"name": alias.hub_id, "hub_id": alias.hub_id, "family": entry.family, "parameters": entry.parameters,
                    "about": f"{alias.kind} of {entry.name}: its config ({entry.family}, "
                             f"{entry.parameters / 1e9:.2f}B parameters)"})
    return out


def check_upload(upload: Upload, uploads: UploadStore) -> None:
    """Refuse an upload the library would refuse, when it arrives (the message names the file as uploaded).

    Raises:
        InputError: a config.json the CLI refuses (not JSON, an unknown architecture, one that needs its own
            code, a field transformers rejects); a recipe file --recipe refuses, or one that names another file
            or a path on the server.
    """
    from anatomist.cli.common import INT_MAX
    from anatomist.token_stats import read_lengths
    from anatomist.workload import load_workload

    try:
        if upload.kind == "config":
            _looks_like_a_config(upload)
            load_workload(str(upload.path))  # as `anatomist estimate config.json` reads it; remote code refused
        elif upload.kind == "lengths":
            read_lengths(str(upload.path), INT_MAX)
        else:
            _read_recipe(upload)
    except InputError as exc:
        raise InputError(_for_the_page(str(exc), uploads)) from None


def run_view(form: Form, uploads: UploadStore, *, allow_network: bool, progress: Progress) -> dict[str, Any]:
    """The page's answer to `form`: the CLI's result object (`--json`) and what the page shows beside it.

    Raises:
        InputError: what the CLI would say in one line on stderr (exit 2), the server's paths taken out.
    """
    with capture.captured() as written:
        try:
            view = _estimate(form, uploads, allow_network, progress) if form.view == "estimate" else \
                _plan(form, uploads, allow_network, progress)
        except InputError as exc:
            raise InputError(_for_the_page(str(exc), uploads)) from None
    notes, _ = capture.notes(written)
    view["messages"] = notes
    return json.loads(uploads.shown(json.dumps(view)))


def _file_flags(form: Form, uploads: UploadStore) -> list[str]:
    """--recipe and --lengths of the uploads the form names, each checked as when it was uploaded."""
    out = []
    if form.get("recipe"):
        upload = uploads.get(form.values["recipe"], "recipe")
        _read_recipe(upload)
        out.append(f"--recipe={upload.path}")
    if form.get("lengths"):
        out.append(f"--lengths={uploads.get(form.values['lengths'], 'lengths').path}")
    return out


def _estimate(form: Form, uploads: UploadStore, allow_network: bool, progress: Progress) -> dict[str, Any]:
    from anatomist.cli.estimate import RULE_SOURCE, build_estimate, largest_batch, verdict, what_would_fit
    from anatomist.trace.store import pool

    model, shown = _model_argument(form, uploads)
    argv = ["estimate", *flags(form, fields()), *_file_flags(form, uploads), *_network(allow_network),
            *(["--", model] if model else [])]
    with pool.watch(progress):
        result = build_estimate(_parse(argv))
        change = what_would_fit(result) if result.memory.max_batch_size == 0 else None
    data = result.to_dict()
    if shown:
        data["model"] = f"uploaded {result.workload.model_type} {shown}"
    anatomy = result.memory.anatomy
    rules = {c: result.memory.rule.describe(c.value) for c in (MemoryCategory.WEIGHTS, MemoryCategory.OPTIMIZER_STATES,
                                                                 MemoryCategory.GRADIENTS)}
    assert anatomy.device_total is not None  # an estimate has it
    word, _ = verdict(result)
    return {
        "kind": "estimate",
        "command": _command(argv, uploads),
        "result": data,
        "verdict": word,
        "largest_batch": largest_batch(result),
        "change": change,
        "rule_source": RULE_SOURCE,
        "anatomy": [{"key": c.value, "label": c.label, "description": c.description, "bytes": anatomy.category_bytes(c),
                     "share": anatomy.category_bytes(c) / anatomy.device_total, "rule": rules.get(c, "")}
                    for c in MemoryCategory],
        "picks": [{"label": "this recipe", "best": True, "recipe": data["recipe"]}],
        "emit": {"model": "MODEL" if shown else result.workload.repo_id, "task": result.workload.task,
                 "seq_len": result.workload.seq_len, "num_gpus": result.num_gpus, "nodes": result.nodes},
    }


def _plan(form: Form, uploads: UploadStore, allow_network: bool, progress: Progress) -> dict[str, Any]:
    from anatomist.cli.plan import build_plan
    from anatomist.recipe_labels import differing, label, shared, summary
    from anatomist.trace.store import pool

    model, shown = _model_argument(form, uploads)
    if not model and not form.get("recipe"):
        raise InputError("name a model (a catalog name or a Hub id) or upload its config.json")
    if not form.get("gpu"):
        raise InputError("name the GPU to plan for")
    argv = ["plan", *flags(form, fields()), *_file_flags(form, uploads), *_network(allow_network),
            *(["--", model] if model else [])]
    with pool.watch(progress):
        result = build_plan(_parse(argv))
    data = result.to_dict()
    if shown:
        data["model"] = f"uploaded {result.workload.model_type} {shown}"
    n = result.space.num_gpus
    entries = [*result.pareto, *([] if result.best in result.pareto else [result.best])]
    facets = differing([c.recipe for c in entries], n)  # the table's columns: what differs among its recipes
    picks = [{
        "best": c is result.best, "cells": {f.key: f.value(c.recipe, n) for f in facets},
        "label": label(c.recipe, facets, n), "summary": summary(c.recipe, n), "device_total": c.device_total,
        "samples_per_second": c.samples_per_second, "recipe": c.recipe.to_dict(), "reasons": c.reasons,
    } for c in entries]
    return {
        "kind": "plan",
        "command": _command(argv, uploads),
        "result": data,
        "columns": [{"key": f.key, "header": f.header} for f in facets],
        "shared": shared([c.recipe for c in entries], n),
        "picks": picks,
        "emit": {"model": "MODEL" if shown else result.workload.repo_id, "task": result.workload.task,
                 "seq_len": result.workload.seq_len, "num_gpus": n, "nodes": result.space.nodes},
    }


def emitted_files(view: dict[str, Any], pick: int, target: str) -> dict[str, str]:
    """The files `plan --emit TARGET -o FILE` writes for the view's pick number `pick`: {file name: text}.

    Raises:
        InputError: no such pick or target.
    """
    from anatomist.plan.emit import TARGETS, write
    from anatomist.recipe import Recipe

    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    if not 0 <= pick < len(view["picks"]):
        raise InputError(f"no pick {pick}: this result has {len(view['picks'])}")
    recipe = Recipe.from_dict(view["picks"][pick]["recipe"])
    emit = view["emit"]
    with tempfile.TemporaryDirectory(prefix="anatomist-emit-") as folder:
        written = write(recipe, target, Path(folder) / EMIT_FILES[target], emit["num_gpus"], model=emit["model"],
                        task=emit["task"], seq_len=emit["seq_len"], nodes=emit.get("nodes", 1))
        return {path.name: path.read_text() for path in written}


def chart_png(view: dict[str, Any], chart: str) -> bytes:
    """One of the report's charts (CHARTS) for the view's result, as PNG bytes.

    Raises:
        InputError: no such chart, or nothing in the result to draw it from.
    """
    from anatomist.report import PNG_DPI, load
    from anatomist.report import charts as report_charts

    draw = {"memory": report_charts.memory_anatomy, "throughput": report_charts.throughput_vs_memory}.get(chart)
    if draw is None:
        raise InputError(f"unknown chart {chart!r}; known: {', '.join(CHARTS)}")
    with _chart_lock:
        fig = draw(load(view["result"]).results)
        if fig is None:
            raise InputError(f"nothing to draw the {chart} chart from")
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=PNG_DPI)
    return buffer.getvalue()


def _network(allow_network: bool) -> list[str]:
    return ["--allow-network"] if allow_network else []


@functools.cache
def _parser() -> Any:
    from anatomist.cli import build_parser

    return build_parser()


def _parse(argv: list[str]) -> Any:
    """The CLI's own parser on `argv`; what it would print and exit 2 with becomes an InputError."""
    with capture.captured() as written:
        try:
            return _parser().parse_args(argv)
        except SystemExit:
            said = "".join(written).strip().splitlines()
            raise InputError(said[-1].removeprefix("anatomist: error: ") if said else "invalid request") from None


def _model_argument(form: Form, uploads: UploadStore) -> tuple[str | None, str | None]:
    """(MODEL for the command line, the name to show for an uploaded config) of the model or config field."""
    model, config = form.get("model"), form.get("config")
    if model and config:
        raise InputError("give a model name or upload a config.json, not both")
    if config:
        upload = uploads.get(config, "config")
        return str(upload.path), upload.name
    if model:
        _refuse_path(model, "model")
    return model, None


def _refuse_path(name: str, what: str) -> None:
    """The page never reads the server's files: a model is a catalog name or a Hub id."""
    if name.startswith(("/", "~", ".", "-", "\\")) or Path(name).expanduser().exists():
        raise InputError(f"{what} {name!r}: the page takes a catalog name or a Hub id, not a path on the server; "
                         "upload the model's config.json instead")


def _read_recipe(upload: Upload) -> None:
    """Read an uploaded recipe file as --recipe does, refusing what would read a file beside it on the server."""
    from anatomist.recipe_files import read_recipe_file
    from anatomist.recipe_files.reading import load_mapping

    for key, value in _references(load_mapping(upload.path)):
        raise InputError(f"{upload.name}: {key} names another file ({value!r}); the page reads one file: write "
                         "that config into it as a mapping, or upload the DeepSpeed or FSDP file itself")
    source = read_recipe_file(upload.path)
    if source.model:
        _refuse_path(source.model, f"{upload.name}'s model")


def _looks_like_a_config(upload: Upload) -> None:
    """Refuse, saying what it is not, a file uploaded as the model's config.json that is not one: a recipe file, a
    tokenizer, a list (what it is said from its keys, before transformers is asked).

    Raises:
        InputError: no `model_type` key (every config.json transformers reads has one).
    """
    try:
        data = json.loads(upload.path.read_text())
    except ValueError:
        return  # load_workload says where the JSON breaks
    if not isinstance(data, dict) or "model_type" in data:
        return
    from anatomist.recipe_files import read_recipe_file

    what = "a model's config.json"
    try:
        source = read_recipe_file(upload.path)
        kind = f": it reads as a recipe file ({source.kind}); upload it as the recipe file instead"
    except InputError:
        kind = f" (it has no model_type; its keys: {', '.join(sorted(data)[:6]) or 'none'})"
    raise InputError(f"{upload.name} is not {what}{kind}")


def _references(data: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(key, file) for each FILE_REFERENCES key, at any depth, whose value is a file name."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in FILE_REFERENCES and isinstance(value, str) and value.strip().lower() not in ("", "none"):
                yield f"{prefix}{key}", value
            yield from _references(value, f"{prefix}{key}.")


def _for_the_page(message: str, uploads: UploadStore) -> str:
    """A library message as the page says it: no server folder, no flag the page cannot pass."""
    for cli, page in CLI_ADVICE.items():
        message = message.replace(cli, page)
    return uploads.shown(message)


def command_of(form: Form, uploads: UploadStore) -> str:
    """The `anatomist estimate|plan ...` line of `form` before it runs (what a failed job advises to run)."""
    model = form.get("model") or ("config.json" if form.get("config") else None)
    files = [f"--{name}={upload.name if (upload := uploads.find(form.values[name])) else name}"
             for name in ("recipe", "lengths") if form.get(name)]
    return "anatomist " + shlex.join([form.view, *flags(form, fields()), *files, *([model] if model else [])])


def _command(argv: list[str], uploads: UploadStore) -> str:
    """The `anatomist ...` line a user would type for the same answer (uploads named as uploaded)."""
    return uploads.shown("anatomist " + shlex.join(a for a in argv if a != "--"))
