"""What the parts share: the run's context, units of work, and running a child process.

A part is a list of units; a unit is the smallest thing a rerun skips once it has a result (one
bench row, one model of the forward/backward grid). Each unit runs in a child process that it
starts in a new process group, so that a unit out of time is killed with everything it started
(an `anatomist bench` kills its own worker only when it is asked to stop, not when it is killed).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from results import ResultsLog

UnitStatus = Literal["ok", "failed", "skipped", "error", "incomplete"]
"""incomplete: stopped by the invocation's time budget, not by its own fault; run again later."""


@dataclass(kw_only=True, slots=True)
class Budget:
    """Seconds this invocation may still use (a lent GPU gives one command 10 minutes)."""

    total_s: float | None
    """None: no limit."""
    start_s: float = field(default_factory=time.monotonic)
    """time.monotonic() at the start of the command the budget counts from."""

    def remaining_s(self) -> float:
        if self.total_s is None:
            return math.inf
        return self.total_s - (time.monotonic() - self.start_s)


@dataclass(kw_only=True, slots=True)
class Context:
    """Everything a part needs to run its units and record them."""

    repo: Path
    here: Path
    """benchmarks/gpu: the driver, its workers and the pytest plugin."""
    out_dir: Path
    log: ResultsLog
    dry_run: bool
    python: str
    budget: Budget

    @property
    def mode(self) -> str:
        return "dry-run" if self.dry_run else "gpu"

    @property
    def bench_results(self) -> Path:
        """`anatomist bench`'s own results file (its format; `anatomist calibrate` reads it)."""
        return self.out_dir / "bench.jsonl"

    def child_env(self, **extra: str) -> dict[str, str]:
        """This environment, with the working tree's anatomist and this folder importable."""
        env = dict(os.environ)
        paths = [str(self.here), str(self.repo / "src"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env


@dataclass(kw_only=True, slots=True)
class Outcome:
    status: UnitStatus
    note: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Unit:
    """One resumable piece of a part."""

    part: str
    name: str
    expected_s: float
    """Its duration on a GPU as estimated before any GPU ran it (plan.py uses what a GPU measured once one has):
    it starts only with this much left."""
    cap_s: float
    """Its hard limit: killed after this, and recorded as an error."""
    run: Callable[[Context, Unit, str, float], Outcome]
    """(context, this unit, attempt id, timeout in seconds) -> outcome; writes its own rows."""
    priority: int = 3
    """1 first, 2 then, 3 the rest (plan.py): lower runs earlier."""
    after: tuple[str, ...] = ()
    """Parts whose pending units must all have run before this one starts (the calibration waits for the bench)."""


@dataclass(kw_only=True, slots=True)
class Finished:
    """A child process's end."""

    returncode: int | None
    """None: killed at its timeout."""
    stdout: str
    stderr_tail: list[str]

    def last_error_line(self) -> str:
        lines = [line for line in self.stderr_tail if line.strip()]
        return lines[-1].strip()[:300] if lines else f"exit code {self.returncode}"


def run_child(cmd: list[str], ctx: Context, timeout_s: float, *, env: dict[str, str] | None = None) -> Finished:
    """Run `cmd` in the repo root; its stderr streams to ours (progress) and its last lines are kept.

    stdout is captured (for `--json` output). On timeout the child's whole process group is
    killed: the child was started in a new session, so the group is exactly what it started.
    """
    tail: deque[str] = deque(maxlen=40)
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, cwd=ctx.repo, env=env or ctx.child_env(), stdout=out, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
        reader.join(timeout=10)
        out.seek(0)
        return Finished(returncode=returncode, stdout=out.read(), stderr_tail=list(tail))


def timed_out(unit: Unit, timeout_s: float) -> Outcome:
    """A child killed at its timeout: the unit's fault at its cap, the budget's otherwise."""
    if timeout_s < unit.cap_s:
        return Outcome(status="incomplete", note=f"stopped after {timeout_s:.0f} s: this invocation's budget ran out")
    return Outcome(status="error", note=f"timed out after {unit.cap_s:.0f} s (the unit's cap)")
