"""What a person reads: the markdown table of predicted vs measured, and the GPU catalog snippet.

Both are rebuilt from the results log at the end of every invocation (they are views of it,
never edited by hand): `table.md` has one line per compared figure of the latest attempt of
every unit, and `gpus-snippet.toml` holds the figures of part a in the form of
src/anatomist/data/gpus.toml, for a person (or a later session) to merge there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from results import ResultsLog

MIB = 2**20
TABLE_COLUMNS = ("part", "case", "quantity", "predicted", "measured", "error %", "status", "note")
SNIPPET_STAGE = "after-training-step"
"""Part a's row whose memory outside the allocator is the catalog's cuda_context_bytes: the
context once a training step's kernels are loaded, which is what stays beside the reserve."""


def fmt(name: str, value: float | None) -> str:
    """A figure for people: bytes below 1 MiB, else MiB; ms for seconds; as is otherwise."""
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return f"{int(value):,} B" if abs(value) < MIB else f"{value / MIB:,.2f} MiB"
    if name.endswith("_s"):
        return f"{value * 1e3:,.2f} ms"
    return f"{value:,.2f}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per quantity that has a number; one line for a row without any (skipped, error)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "|".join(" --- " for _ in TABLE_COLUMNS) + "|"]
    for r in rows:
        note = (r.get("reason") or "")[:120]
        numbered = {k: q for k, q in (r.get("quantities") or {}).items()
                    if q.get("predicted") is not None or q.get("measured") is not None}
        if not numbered:
            lines.append("| " + " | ".join(_cell(x) for x in (r["part"], r["name"], "-", "-", "-", "-",
                                                               r["status"], note)) + " |")
            continue
        for name, q in numbered.items():
            err = "-" if q.get("error_pct") is None else f"{q['error_pct']:+.2f}"
            lines.append("| " + " | ".join(_cell(x) for x in (
                r["part"], r["name"], name, fmt(name, q.get("predicted")), fmt(name, q.get("measured")), err,
                r["status"], note)) + " |")
    return lines


def header_lines(env: dict[str, Any] | None, progress: dict[str, str]) -> list[str]:
    env = env or {}
    device, versions = env.get("device") or {}, env.get("versions") or {}
    lines = [f"# GPU validation: {device.get('name', 'unknown device')}", ""]
    if env.get("mode") == "dry-run":
        lines += ["**DRY RUN on a CPU**: the plumbing ran; no figure below was measured on a GPU.", ""]
    lines += [
        f"- date (last invocation): {env.get('time', '-')}",
        f"- device: {device.get('name', '-')} ({_gib(device.get('memory_bytes'))}), catalog entry "
        f"{device.get('catalog_name') or 'none'}, driver {device.get('driver') or '-'}",
        f"- CUDA {versions.get('cuda') or '-'}, torch {versions.get('torch') or '-'}, transformers "
        f"{versions.get('transformers') or '-'}, accelerate {versions.get('accelerate') or '-'}, anatomist "
        f"{versions.get('anatomist') or '-'}, Python {versions.get('python') or '-'}",
        "- parts: " + ", ".join(f"{p} {state}" for p, state in progress.items()),
        "- error % = (predicted - measured) / measured x 100; MiB = 2**20 bytes. Rows: results.jsonl.",
        "",
    ]
    return lines


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def write_table(log: ResultsLog, out: Path, progress: dict[str, str]) -> Path:
    path = out / "table.md"
    lines = header_lines(log.latest_env(), progress) + table_lines(log.latest_rows())
    path.write_text("\n".join(lines) + "\n")
    return path


def write_snippet(log: ResultsLog, out: Path) -> Path:
    """gpus.toml keys for this device from part a; a commented placeholder until it has run."""
    env = log.latest_env() or {}
    device, versions = env.get("device") or {}, env.get("versions") or {}
    stages = {r["name"]: r for r in log.latest_rows() if r["part"] == "a"}
    entry = device.get("catalog_name") or device.get("slug") or "unknown"
    measured = {name: (r["quantities"].get("outside_allocator_bytes") or {}).get("measured")
                for name, r in stages.items() if "outside_allocator_bytes" in r["quantities"]}
    context = measured.get(SNIPPET_STAGE)
    stack = (f"{device.get('name')}, driver {device.get('driver')}, CUDA {versions.get('cuda')}, torch "
             f"{versions.get('torch')}, transformers {versions.get('transformers')}")
    date = str(stages[SNIPPET_STAGE]["time"])[:10] if SNIPPET_STAGE in stages else "-"
    lines = [
        "# The runtime overhead measured by benchmarks/gpu/validate.sh (part a), in the form of",
        "# src/anatomist/data/gpus.toml: merge these keys into that entry, replacing the [defaults]",
        "# assumption for this GPU. Do not paste the table header twice.",
        f"# {stack}",
        "# memory outside the caching allocator at each stage (NVML used - before CUDA - reserved):",
    ]
    lines += [f"#   {name}: {fmt('x_bytes', value)}" for name, value in measured.items()]
    if env.get("mode") == "dry-run" or context is None:
        lines += ["# NOT MEASURED: " + ("a dry run on a CPU" if env.get("mode") == "dry-run" else "part a has no figure"),
                  f"[gpus.{json.dumps(entry)}]", "# cuda_context_bytes = <part a on the GPU>"]
    else:
        source = (f"measured {date} by benchmarks/gpu/validate.sh part a: memory outside the caching allocator after "
                  f"two training steps ({stages[SNIPPET_STAGE]['details'].get('model')}): CUDA context, lazily loaded "
                  f"kernels, library handles; {stack}")
        lines += [f"[gpus.{json.dumps(entry)}]",
                  f"cuda_context_bytes = {int(context)}   # {context / MIB:,.0f} MiB",
                  f"cuda_context_source = {json.dumps(source)}"]
    path = out / "gpus-snippet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
