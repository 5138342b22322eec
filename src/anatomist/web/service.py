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
from anatomist.web.form import Field, Form, Kind, flags
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


@functools.cache
def fields() -> tuple[Field, ...]:
    """The page's fields: the model, the options estimate and plan share, every Recipe field (from the
    dataclass: its name, Literal choices, help and default, as the CLI's flags are made), the plan's search."""
    from anatomist.axes.optimizers import DEFAULT_SEARCH, OPTIMIZERS
    from anatomist.axes.precisions import FULL_PRECISIONS
    from anatomist.axes.shardings import SHARDING_NAMES
    from anatomist.cli.estimate import DEFAULT_GPU, DEFAULT_MODEL
    from anatomist.cli.recipe_flags import flag_name
    from anatomist.plan.candidates import Objective
    from anatomist.recipe import Recipe, field_kinds
    from anatomist.workload import TASKS

    est, plan = ("estimate",), ("plan",)
    out = [
        Field(name="model", flag=None, kind="str", section="model", default=DEFAULT_MODEL,
              help="A catalog name (anatomist models) or a Hub id; or upload the model's config.json."),
        Field(name="config", flag=None, kind="upload", section="model",
              help="The model's config.json: read as JSON, never executed; a model that needs its own code is refused."),
        Field(name="recipe", flag=None, kind="upload", section="model", views=est,
              help="Your TrainingArguments, TRL (trl sft --config), accelerate or DeepSpeed file, JSON or YAML, "
                   "as --recipe reads it; the fields below override it."),
        Field(name="gpu", flag="--gpu", kind="str", section="common", default=DEFAULT_GPU,
              help="Target GPU: a catalog name or as people write it (4090, a100 80gb, H100)."),
        Field(name="seq_len", flag="--seq-len", kind="int", section="common", default=512,
              help="Tokens per sample (512, or the model's maximum if lower)."),
        Field(name="task", flag="--task", kind="choice", section="common", choices=TASKS,
              help="The head trained (default: sequence classification for encoders, causal LM for decoders)."),
        Field(name="gpus", flag="--gpus", kind="int", section="common", default=1,
              help="Data-parallel GPUs (ZeRO and FSDP shard across them)."),
        Field(name="memory_margin", flag="--memory-margin", kind="float", section="common",
              default=DEFAULT_MEMORY_MARGIN, help="Share of the GPU's memory kept free when deciding what fits."),
        Field(name="mode", flag="--mode", kind="choice", section="common", choices=("train", "inference"),
              default="train", views=est, help="A training step, or a forward pass only."),
    ]
    kinds, defaults = field_kinds(), Recipe().to_dict()
    for f in dataclasses.fields(Recipe):
        kind = kinds[f.name]
        web_kind = "bool" if kind.type is bool else "choice" if kind.choices is not None else kind.type.__name__
        out.append(Field(name=f.name, flag=flag_name(f.name), kind=cast(Kind, web_kind), section="recipe", choices=kind.choices,
                         default=defaults[f.name], help=f.metadata["help"], views=est))
    out += [
        Field(name="global_batch_size", flag="--global-batch-size", kind="int", section="search", views=plan,
              help="Samples per optimizer step over all GPUs (empty: any batch, no accumulation)."),
        Field(name="objective", flag="--objective", kind="choice", section="search", choices=get_args(Objective),
              default="throughput", views=plan, help="The top pick: the fastest that fits, or the smallest."),
        Field(name="optims", flag="--optims", kind="multi", section="search", choices=tuple(OPTIMIZERS),
              default=list(DEFAULT_SEARCH), views=plan, help="Optimizers searched."),
        Field(name="precisions", flag="--precisions", kind="multi", section="search", choices=FULL_PRECISIONS,
              views=plan, help="Precisions searched (none ticked: all the GPU supports)."),
        Field(name="shardings", flag="--shardings", kind="multi", section="search", choices=SHARDING_NAMES, views=plan,
              help="Sharding options searched, each where it runs (none ticked: all those of the GPU count)."),
        Field(name="no_compile", flag="--no-compile", kind="flag", section="search", views=plan,
              help="Do not consider torch.compile."),
        Field(name="peft", flag="--peft", kind="multi", section="search", choices=("lora", "qlora"), views=plan,
              help="Also search LoRA (bf16/fp32 base) and QLoRA (4-bit NF4 base): they change what is trained."),
    ]
    for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
        f = next(f for f in dataclasses.fields(Recipe) if f.name == name)
        out.append(Field(name=name, flag=flag_name(name), kind=cast(Kind, kinds[name].type.__name__), section="search",
                         default=defaults[name], help=f.metadata["help"], views=plan))
    return tuple(out)


def schema(*, allow_network: bool) -> dict[str, Any]:
    """What the page builds its form from: the fields, the model and GPU catalogs, the memory categories."""
    from anatomist.hardware import catalog
    from anatomist.model_catalog import catalog_entries, summarize
    from anatomist.plan.emit import TARGETS
    from anatomist.report.charts import CATEGORY_COLOURS
    from anatomist.web.uploads import MAX_UPLOAD_BYTES

    models = [summarize(e) for e in catalog_entries().values()]
    return {
        "fields": [f.to_dict() for f in fields()],
        "models": [{"name": m.name, "hub_id": m.hub_id, "family": m.family, "parameters": m.parameters} for m in models],
        "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes, "aliases": list(g.aliases)}
                 for g in catalog().values()],
        "categories": [{"key": c.value, "label": c.label, "colour": CATEGORY_COLOURS[c]} for c in MemoryCategory],
        "targets": [{"name": t, "file": EMIT_FILES[t]} for t in TARGETS],
        "allow_network": allow_network,
        "max_upload_bytes": MAX_UPLOAD_BYTES,
    }


def check_upload(upload: Upload, uploads: UploadStore) -> None:
    """Refuse an upload the library would refuse, when it arrives (the message names the file as uploaded).

    Raises:
        InputError: a config.json the CLI refuses (not JSON, an unknown architecture, one that needs its own
            code, a field transformers rejects); a recipe file --recipe refuses, or one that names another file
            or a path on the server.
    """
    from anatomist.workload import load_workload

    try:
        if upload.kind == "config":
            load_workload(str(upload.path))  # as `anatomist estimate config.json` reads it; remote code refused
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


def _estimate(form: Form, uploads: UploadStore, allow_network: bool, progress: Progress) -> dict[str, Any]:
    from anatomist.cli.estimate import build_estimate
    from anatomist.trace import pool

    model, shown = _model_argument(form, uploads)
    recipe_flag: list[str] = []
    if form.get("recipe"):
        upload = uploads.get(form.values["recipe"], "recipe")
        _read_recipe(upload)
        recipe_flag = [f"--recipe={upload.path}"]
    argv = ["estimate", *flags(form, fields()), *recipe_flag, *_network(allow_network),
            *(["--", model] if model else [])]
    with pool.watch(progress):
        result = build_estimate(_parse(argv))
    data = result.to_dict()
    if shown:
        data["model"] = f"uploaded {result.workload.model_type} {shown}"
    anatomy = result.memory.anatomy
    rules = {c: result.memory.rule.describe(c.value) for c in (MemoryCategory.WEIGHTS, MemoryCategory.OPTIMIZER_STATES,
                                                                 MemoryCategory.GRADIENTS)}
    assert anatomy.device_total is not None  # an estimate has it
    return {
        "kind": "estimate",
        "command": _command(argv, uploads),
        "result": data,
        "anatomy": [{"key": c.value, "label": c.label, "bytes": anatomy.category_bytes(c),
                     "share": anatomy.category_bytes(c) / anatomy.device_total, "rule": rules.get(c, "")}
                    for c in MemoryCategory],
        "picks": [{"label": "this recipe", "best": True, "recipe": data["recipe"]}],
        "emit": {"model": "MODEL" if shown else result.workload.repo_id, "task": result.workload.task,
                 "seq_len": result.workload.seq_len, "num_gpus": form.get("gpus") or 1},
    }


def _plan(form: Form, uploads: UploadStore, allow_network: bool, progress: Progress) -> dict[str, Any]:
    from anatomist.axes.precisions import precision_of
    from anatomist.axes.shardings import sharding_of
    from anatomist.cli.plan import build_plan
    from anatomist.plan.space import method_of
    from anatomist.trace import pool

    model, shown = _model_argument(form, uploads)
    if not model:
        raise InputError("name a model (a catalog name or a Hub id) or upload its config.json")
    if not form.get("gpu"):
        raise InputError("name the GPU to plan for")
    argv = ["plan", *flags(form, fields()), *_network(allow_network), "--", model]
    with pool.watch(progress):
        result = build_plan(_parse(argv))
    data = result.to_dict()
    if shown:
        data["model"] = f"uploaded {result.workload.model_type} {shown}"
    n = result.space.num_gpus
    entries = [*result.pareto, *([] if result.best in result.pareto else [result.best])]
    picks = [{
        "best": c is result.best, "method": method_of(c.recipe),
        "batch": f"{c.recipe.per_device_train_batch_size} x {c.recipe.gradient_accumulation_steps}",
        "checkpointing": c.recipe.gradient_checkpointing, "precision": precision_of(c.recipe), "optim": c.recipe.optim,
        "compile": c.recipe.torch_compile, "sharding": sharding_of(c.recipe, n),
        "attention": c.recipe.attn_implementation, "device_total": c.device_total,
        "samples_per_second": c.samples_per_second, "recipe": c.recipe.to_dict(), "reasons": c.reasons,
    } for c in entries]
    return {
        "kind": "plan",
        "command": _command(argv, uploads),
        "result": data,
        "picks": picks,
        "emit": {"model": "MODEL" if shown else result.workload.repo_id, "task": result.workload.task,
                 "seq_len": result.workload.seq_len, "num_gpus": n},
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
                        task=emit["task"], seq_len=emit["seq_len"])
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


def _command(argv: list[str], uploads: UploadStore) -> str:
    """The `anatomist ...` line a user would type for the same answer (uploads named as uploaded)."""
    return uploads.shown("anatomist " + shlex.join(a for a in argv if a != "--"))
