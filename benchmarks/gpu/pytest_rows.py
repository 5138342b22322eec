"""Part b: a pytest plugin that turns each `pytest -m gpu` case into a row of the results log.

    VALIDATE_RESULTS=PATH VALIDATE_ATTEMPT=ID VALIDATE_MODE=gpu|dry-run \
        python -m pytest -m gpu tests/test_gpu.py -p pytest_rows     (with this folder on PYTHONPATH)

Each case gives one row: passed -> ok, failed -> failed (the assertion's first line as reason),
skipped -> skipped (pytest's reason). tests/test_gpu.py asserts prediction ~ measurement but
does not report the numbers, so, without changing the test, this plugin watches the two calls
it makes for a case: the `estimate_memory` it calls (the prediction) and the `subprocess.run`
whose last stdout line is `{"allocated": ..., "reserved": ...}` (torch.cuda.max_memory_* of
the real step). Where a future version of the test makes other calls, the rows still carry
the outcome; only the numbers go missing.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from results import ResultsLog, quantity

PART, UNIT = "b", "pytest-gpu"


class _Spy:
    """What one test case predicted and measured, caught from its calls."""

    def __init__(self) -> None:
        self.predicted: dict[str, int] = {}
        self.measured: dict[str, int] = {}

    def wrap_estimate(self, real: Any) -> Any:
        def estimate_memory(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            anatomy = out.anatomy
            self.predicted = {"allocated": anatomy.peak_allocated, "reserved": anatomy.peak_reserved}
            return out

        return estimate_memory

    def wrap_run(self, real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            proc = real(*args, **kwargs)
            lines = (proc.stdout or "").strip().splitlines() if isinstance(proc.stdout, str) else []
            try:
                last = json.loads(lines[-1]) if lines else None
            except ValueError:
                last = None
            if isinstance(last, dict) and {"allocated", "reserved"} <= set(last):
                self.measured = {"allocated": int(last["allocated"]), "reserved": int(last["reserved"])}
            return proc

        return run


_SPY = pytest.StashKey[_Spy]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    spy = _Spy()
    module = getattr(item, "module", None)
    patches: list[tuple[Any, str, Any]] = []
    if module is not None and callable(getattr(module, "estimate_memory", None)):
        patches.append((module, "estimate_memory", spy.wrap_estimate(module.estimate_memory)))
    patches.append((subprocess, "run", spy.wrap_run(subprocess.run)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
        item.stash[_SPY] = spy


def _log() -> tuple[ResultsLog, str, str]:
    return ResultsLog(path=Path(os.environ["VALIDATE_RESULTS"])), os.environ["VALIDATE_ATTEMPT"], \
        os.environ.get("VALIDATE_MODE", "gpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    first_outcome = report.when == "call" or (report.when == "setup" and report.outcome != "passed")
    if not first_outcome:
        return
    log, attempt, mode = _log()
    spy = item.stash.get(_SPY, _Spy())
    if report.passed:
        status, reason = "ok", None
    elif report.skipped:
        status = "skipped"
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    else:
        status = "failed" if report.when == "call" else "error"
        text = call.excinfo.exconly() if call.excinfo is not None else report.longreprtext
        reason = (text or "failed").strip().splitlines()[0][:300]
    log.row(part=PART, unit=UNIT, attempt=attempt, name=item.nodeid.split("::", 1)[-1], status=status, mode=mode,
            reason=reason, details={"nodeid": item.nodeid, "duration_s": round(report.duration, 3)},
            quantities={
                "peak_allocated_bytes": quantity(spy.predicted.get("allocated"), spy.measured.get("allocated")),
                "peak_reserved_bytes": quantity(spy.predicted.get("reserved"), spy.measured.get("reserved")),
            })
