"""Every call the page makes into anatomist, in one place.

The page asks what `anatomist estimate` and `anatomist plan` answer, so its form becomes the request
the CLI makes of their flags (`form.estimate_request` / `form.plan_request`, `cli.requests`) and goes
through the CLI's own `build_estimate` / `build_plan`; the "same as" command it shows is the form's
flags (`form.flags`): the page, the CLI and that command agree by construction. The rest is the report's charts (`report.load`, `report.charts`) and the
files `plan.emit.write` writes. Only this module imports the library's computing parts; when the
library changes, this is the file to adapt.

What the page may not do that the CLI may: name a path on the server (a model or a file a recipe
file refers to; upload the file instead), run a model's own code (`--trust-remote-code` is never
passed), reach the Hub unless the server was started with `--allow-network`.
"""

from __future__ import annotations

import io
import json
import shlex
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from anatomist.anatomy import MemoryCategory
from anatomist.errors import InputError
from anatomist.web import capture
from anatomist.web.fields import fields
from anatomist.web.form import Files, Form, estimate_request, flags, plan_request
from anatomist.web.uploads import Upload, UploadStore

Progress = Callable[[int, int], None]
"""Called with (step parts traced, step parts to trace) while a cold trace runs."""

EMIT_FILES = {"trainer": "training_args.json", "accelerate": "accelerate_config.yaml", "deepspeed": "ds_config.json",
              "trl": "sft.yaml"}
"""The file each `plan --emit` target is written to (the trainer snippet names ds_config.json)."""
CHARTS = ("memory", "throughput")
FILE_REFERENCES = ("deepspeed", "fsdp_config", "deepspeed_config_file")
"""Keys whose string value makes a recipe file read another file (recipe/files: referenced_file)."""
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
    import anatomist.recipe.files  # noqa: F401
    import anatomist.report.charts  # noqa: F401

    fields()


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
    from anatomist.workload_loader import load_workload

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


def _files(form: Form, uploads: UploadStore, model: str | None) -> Files:
    """What `model` (`_model_argument`) and the form's uploads name on the server, each upload checked as when it
    was uploaded."""
    recipe = lengths = None
    if form.get("recipe"):
        upload = uploads.get(form.values["recipe"], "recipe")
        _read_recipe(upload)
        recipe = str(upload.path)
    if form.get("lengths"):
        lengths = str(uploads.get(form.values["lengths"], "lengths").path)
    return Files(model=model, recipe=recipe, lengths=lengths)


def _argv(form: Form, files: Files, allow_network: bool) -> list[str]:
    """The command line a user would type for the same answer (the uploads by their paths here)."""
    uploaded = [f"--recipe={files.recipe}"] if files.recipe else []
    uploaded += [f"--lengths={files.lengths}"] if files.lengths else []
    return [form.view, *flags(form, fields()), *uploaded, *(["--allow-network"] if allow_network else []),
            *(["--", files.model] if files.model else [])]


def _estimate(form: Form, uploads: UploadStore, allow_network: bool, progress: Progress) -> dict[str, Any]:
    from anatomist.cli.estimate import RULE_SOURCE, build_estimate, largest_batch, longest_line, verdict, what_would_fit
    from anatomist.trace.store import pool

    model, shown = _model_argument(form, uploads)
    files = _files(form, uploads, model)
    with pool.watch(progress):
        result = build_estimate(estimate_request(form, files, allow_network=allow_network))
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
        "command": _command(_argv(form, files, allow_network), uploads),
        "result": data,
        "verdict": word,
        "largest_batch": largest_batch(result),
        "change": change,
        "longest": longest_line(result) if result.longest is not None else None,
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
    files = _files(form, uploads, model)
    with pool.watch(progress):
        result = build_plan(plan_request(form, files, allow_network=allow_network))
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
        "command": _command(_argv(form, files, allow_network), uploads),
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
    from anatomist.recipe.files import read_recipe_file
    from anatomist.recipe.files.reading import load_mapping

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
    from anatomist.recipe.files import read_recipe_file

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
