"""Every watched run, kept: one JSON line per run in `<user cache>/calibration/runs.jsonl`.

A record is a bench row (`bench/store.py`'s ROW_KEYS, plus `workload`), so `anatomist calibrate
--records` reads it as it reads the rows `anatomist bench` writes: the model (its config.json
inline), the recipe, the device (GPU name, memory, driver), the package versions, what was
predicted and what was measured after the first steps.

Appending is atomic line by line: each record is one `os.write` of one line on an O_APPEND file
descriptor (POSIX appends a single write at the end as a whole; two runs finishing together do
not interleave), then fsync; after a torn last line the record starts on a line of its own. Reading never fails on a broken or partial line (a run killed
mid-write, a hand edit): the line is skipped with a warning naming it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from anatomist.errors import InputError
from anatomist.user_cache import cache_root

RECORDS_NAME = "runs.jsonl"


def records_path() -> Path:
    """`<user cache>/calibration/runs.jsonl` (the folder the per-GPU calibrations live in)."""
    return cache_root() / "calibration" / RECORDS_NAME


def append_record(record: dict[str, Any], path: str | Path | None = None) -> Path:
    """Append `record` as one line to `path` (default `records_path()`); returns the path.

    Raises:
        OSError: the folder cannot be made or the file written.
        TypeError, ValueError: `record` is not JSON-serialisable (nothing is written).
    """
    target = Path(path) if path is not None else records_path()
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # after a torn last line: this record starts a line of its own
        written = os.write(fd, line)
        if written != len(line):  # a full disk: a partial line, which readers skip
            raise OSError(f"{target}: wrote {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
    return target


def read_records(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The records of `path` (default `records_path()`), in order; a line that is not a whole
    record is skipped with a warning.

    Raises:
        InputError: `path` does not exist, is a folder or is empty.
    """
    source = Path(path) if path is not None else records_path()
    if not source.is_file():
        raise InputError(f"run records {str(source)!r}: no such file (AnatomistCallback and track() write it "
                         "after a run's first steps)")
    rows: list[dict[str, Any]] = []
    with source.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            text = raw.decode("utf-8", errors="replace").strip()
            if not text:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                warnings.warn(f"{source}:{number}: skipped, not a whole JSON record ({exc.msg})", stacklevel=2)
                continue
            if not isinstance(row, dict) or not {"name", "status", "workload", "recipe", "device"} <= set(row):
                warnings.warn(f"{source}:{number}: skipped, not a run record", stacklevel=2)
                continue
            rows.append(row)
    if not rows and not source.read_bytes().strip():
        raise InputError(f"run records {str(source)!r} is empty")
    return rows
