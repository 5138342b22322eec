"""The validation log: one JSON object per line, appended with flush + fsync, never rewritten.

Every part of `validate.py` (and the workers it starts) writes here. Three kinds of line:

- a measurement row: `{"part", "unit", "attempt", "name", "status", "mode", "quantities",
  "details", "reason"}`, where `quantities` maps a name with its unit (`peak_allocated_bytes`,
  `forward_s`) to `{"predicted": x | null, "measured": y | null, "error_pct": z | null}`;
- a marker `{"record": "unit-done", "part", "unit", "attempt", "status"}` written once a unit
  (one bench row, one model of the forward/backward grid, ...) has a result, even an error;
- `{"record": "redo", "part"}` (from `--redo PART`): earlier markers of that part no longer count,
  and `{"record": "env", ...}`: the device and versions of one invocation.

Why append-only: a run killed at any moment (a 10-minute limit, an OOM that takes the process
down) loses no finished line, a torn last line is recognised and ignored, and a rerun only needs
to read the markers to know what is left. Rows of a unit run twice are told apart by `attempt`;
readers keep the latest attempt of each unit.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "error", "skipped", "failed")
"""ok: measured; oom / error: the run failed (the reason says how); skipped: not run here (the
reason says why); failed: ran, and a check (a pytest assertion) failed."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def new_attempt() -> str:
    """An id for one run of one unit: its start time and a random suffix, unique across machines."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured x 100, rounded to 0.01; None where a side is missing."""
    if predicted is None or measured is None or measured == 0:
        return None
    return round((predicted - measured) / measured * 100, 2)


def quantity(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    """One compared figure, with its error."""
    return {"predicted": predicted, "measured": measured, "error_pct": error_pct(predicted, measured)}


@dataclass(kw_only=True, slots=True)
class ResultsLog:
    """The JSONL file of one device's validation run."""

    path: Path

    def append(self, row: dict[str, Any]) -> None:
        """Write one line durably (flush + fsync) before returning."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"validate": SCHEMA_VERSION, "time": now_iso(), **row}, default=str) + "\n"
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def row(
        self,
        *,
        part: str,
        unit: str,
        attempt: str,
        name: str,
        status: str,
        mode: str,
        quantities: dict[str, dict[str, float | None]] | None = None,
        details: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> None:
        """Append one measurement row (see the module docstring for the fields)."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        self.append({"part": part, "unit": unit, "attempt": attempt, "name": name, "status": status, "mode": mode,
                     "quantities": quantities or {}, "details": details or {}, "reason": reason})

    def repair(self) -> None:
        """Cut a torn last line (a write cut short by a kill), so that the next append starts clean.

        Call it before anything appends: the driver does, once, before any child runs.
        """
        if not self.path.is_file():
            return
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        if end < len(raw):
            print(f"validate: {self.path}: dropping an unfinished last line left by an interrupted run",
                  file=sys.stderr)
            with self.path.open("r+b") as fh:
                fh.truncate(end)
                fh.flush()
                os.fsync(fh.fileno())

    def lines(self) -> list[dict[str, Any]]:
        """Every complete line (a torn last line is not one); a corrupt line is named."""
        if not self.path.is_file():
            return []
        body = self.path.read_text(encoding="utf-8").split("\n")
        out = []
        for number, line in enumerate(body[:-1], start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{self.path}: line {number} is corrupt ({exc}); remove that line") from None
        return out

    def done_units(self, part: str) -> dict[str, dict[str, Any]]:
        """unit -> its latest `unit-done` marker, counting only markers after the part's last redo."""
        done: dict[str, dict[str, Any]] = {}
        for line in self.lines():
            if line.get("part") != part:
                continue
            if line.get("record") == "redo":
                done.clear()
            elif line.get("record") == "unit-done":
                done[line["unit"]] = line
        return done

    def latest_rows(self) -> list[dict[str, Any]]:
        """Measurement rows of the latest attempt of each (part, unit), in file order."""
        rows = [line for line in self.lines() if "record" not in line and "part" in line]
        latest = {(r["part"], r["unit"]): r["attempt"] for r in rows}  # the file is in time order: last wins
        return [r for r in rows if r["attempt"] == latest[(r["part"], r["unit"])]]

    def latest_env(self) -> dict[str, Any] | None:
        envs = [line for line in self.lines() if line.get("record") == "env"]
        return envs[-1] if envs else None
