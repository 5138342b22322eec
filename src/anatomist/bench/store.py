"""The results file: JSON Lines, one finished row per line, appended with flush + fsync.

Why JSONL rather than SQLite: a row is written by a single `write` of one line followed by
`fsync`, so a finished row is on disk before the next row starts, and a bench killed at
any moment (even SIGKILL) leaves every finished row intact; at worst a torn last line
without its newline, which is recognised and dropped (it was never a finished row). The
file is readable and greppable as is, and its lines are exactly the rows `--json`
prints, so `anatomist report` and other tools read one format. SQLite would give the same
durability but a binary file and a schema to migrate, for no query we need.

Line 1 is a header that identifies the file: {"anatomist_results": SCHEMA_VERSION, ...}.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anatomist.errors import InputError

SCHEMA_VERSION = 1
ROW_KEYS = ("name", "model", "recipe", "device", "versions", "status", "reason", "measured", "predicted", "error_pct")
STATUSES = ("ok", "oom", "error", "skipped")


@dataclass(kw_only=True, slots=True)
class ResultsFile:
    """An opened results file: its header and the finished rows already in it."""

    path: Path
    header: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def finished(self) -> set[tuple[str, str, int]]:
        """`row_key` of every row already recorded, whatever its status."""
        return {row_key(r) for r in self.rows}

    def append(self, row: dict[str, Any]) -> None:
        """Write one row durably: one line, flushed and fsynced before returning."""
        line = json.dumps(row, sort_keys=False) + "\n"
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        self.rows.append(row)


def row_key(row: dict[str, Any]) -> tuple[str, str, int]:
    """What makes a row the same row for --resume: its suite, its name and how many processes ran it
    (a row written before distributed rows were stored ran on one)."""
    return row.get("suite", ""), row["name"], int(row.get("num_processes", 1))


def validate_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be a JSON object")
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise InputError(f"{where}: not an anatomist result row (missing {', '.join(missing)})")
    if row["status"] not in STATUSES:
        raise InputError(f"{where}: status must be one of {', '.join(STATUSES)}, got {row['status']!r}")
    return row


def open_results(path: str | Path, *, create: bool = True) -> ResultsFile:
    """Open (or create) a results file and read its rows.

    Raises:
        InputError: the file is not an anatomist results file, has a newer schema, or a line
            (named by its number) is not a valid row. Nothing is written in that case.
    """
    p = Path(path)
    if p.is_dir():
        raise InputError(f"results path {str(p)!r} is a directory; give a file name such as results.jsonl")
    if not create and (not p.exists() or not p.read_bytes().strip()):
        raise InputError(f"results file {str(p)!r} {'is empty' if p.exists() else 'does not exist'}")
    if not p.exists() or p.stat().st_size == 0:
        p.parent.mkdir(parents=True, exist_ok=True)
        new = {"anatomist_results": SCHEMA_VERSION, "format": "one JSON row per line, see docs/bench.md"}
        with p.open("w", encoding="utf-8") as fh:
            fh.write(json.dumps(new) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return ResultsFile(path=p, header=new)
    raw = p.read_bytes()
    lines = raw.split(b"\n")
    torn = lines[-1] != b""  # a last line without newline: a write cut short, never a finished row
    body = lines[:-1]
    if not body:
        raise InputError(f"{p}: line 1 is not an anatomist results header")
    try:
        header = json.loads(body[0])
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or "anatomist_results" not in header:
        advice = "; choose another --results path" if create else " (`anatomist bench` writes one)"
        raise InputError(f"{p}: not an anatomist results file (line 1 is not its header){advice}")
    if header["anatomist_results"] != SCHEMA_VERSION:
        raise InputError(f"{p}: results schema {header['anatomist_results']!r}; this anatomist reads {SCHEMA_VERSION}")
    rows = []
    for number, line in enumerate(body[1:], start=2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"{p}: line {number} is corrupt ({exc}); fix or remove that line") from None
        rows.append(validate_row(row, f"{p}: line {number}"))
    if torn:
        print(f"anatomist: {p}: dropping an unfinished last line (line {len(body) + 1}) left by an interrupted run",
              file=sys.stderr)
        with p.open("r+b") as fh:
            fh.truncate(len(raw) - len(lines[-1]))
            fh.flush()
            os.fsync(fh.fileno())
    return ResultsFile(path=p, header=header, rows=rows)
