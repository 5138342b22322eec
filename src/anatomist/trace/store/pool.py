"""Trace several step parts at once, in processes forked from this one.

A plan needs a few dozen traces, an estimate six; each is a few tenths of a second of
single-threaded Python (fake-tensor dispatch), so they are traced side by side, one process
per core. The workers are forked: they start with torch, transformers and the model's config
already imported, where a fresh interpreter would spend seconds importing them again.

Only where forking is safe (Linux; macOS frameworks are not fork-safe). A job that fails in a
worker comes back as None: the caller traces it again in this process, where its error is
raised as usual. The workers' stderr goes to /dev/null (the same warnings once per process
would repeat); what a trace has to say reaches the user from the parent's own traces.

`ANATOMIST_JOBS` sets the number of processes (1: trace in this process only).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from anatomist.errors import InputError

MAX_JOBS = 8
"""At most this many worker processes (each holds its own copy of the traced model's tensors' metadata)."""

_watchers: list[Callable[[int, int], None]] = []
"""Called with (jobs done, jobs) as the workers finish (`watch`)."""

_kept: list[ProcessPoolExecutor | None] = []
"""The workers kept for the innermost `kept()` block (None until its first `run_all` starts them)."""


def jobs() -> int:
    """How many processes trace at once: ANATOMIST_JOBS, else the cores this process may use (at most MAX_JOBS);
    1 where forking is unsafe.

    Raises:
        InputError: ANATOMIST_JOBS is not a whole number of at least 1.
    """
    wanted = os.environ.get("ANATOMIST_JOBS", "").strip()
    if wanted and not (wanted.isdigit() and int(wanted) >= 1):
        raise InputError(f"ANATOMIST_JOBS must be a whole number of processes, 1 or more; got {wanted!r}")
    if sys.platform != "linux":
        return 1
    return int(wanted) if wanted else max(1, min(MAX_JOBS, len(os.sched_getaffinity(0))))


def run_all(work: Sequence[Callable[[], Any]]) -> Iterator[tuple[int, Any]]:
    """Run each of `work` (picklable: a module-level function, or a functools.partial of one) in a
    forked worker; yield (index, result) as each finishes, result None where the job raised. Yields
    nothing where fewer than two processes would run (see `jobs`), and stops early where the workers
    cannot be started or one dies (killed, out of memory): the caller runs what it did not get itself.

    Inside a `kept()` block the workers outlive the call, for the block's next `run_all`."""
    keep = bool(_kept)
    executor = _kept[-1] if keep else None
    processes = jobs() if keep else min(jobs(), len(work))
    if not work or (executor is None and processes < 2) or multiprocessing.current_process().daemon:  # a daemon may not fork
        return
    futures: dict[Future[Any], int] = {}
    finished = False
    try:
        if executor is None:
            executor = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), initializer=_quiet)
            if keep:
                _kept[-1] = executor
        gc.freeze()  # the workers share this process's pages: keep the collector from touching (copying) them
        try:  # a new executor forks all its workers at the first submit, before it starts its thread
            futures = {executor.submit(_run, job): index for index, job in enumerate(work)}
        finally:
            gc.unfreeze()
        for report in _watchers:
            report(0, len(work))
        for done, future in enumerate(as_completed(futures), start=1):
            try:
                result = future.result()
            except BrokenProcessPool:
                raise
            except Exception:  # noqa: BLE001 - not sent (a job that does not pickle): the caller runs it
                result = None
            for report in _watchers:
                report(done, len(work))
            yield futures[future], result
        finished = True
    except (OSError, BrokenProcessPool):
        return
    finally:
        for future in futures:  # interrupted: the running jobs end on their own, the rest never start
            future.cancel()
        if executor is not None and not (keep and finished):
            executor.shutdown(wait=finished, cancel_futures=True)
            if keep:
                _kept[-1] = None  # the next call starts new workers


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Within the block, the workers the first `run_all` forks serve every later one, already started
    and warmed up (torch's fake-tensor dispatch cache filled by their earlier traces): a plan traces
    its candidates, then the alternatives its reasons compare. A block inside another shares the outer one's
    workers (`plan --max-nodes` plans each cluster size with the same)."""
    if _kept:
        yield
        return
    _kept.append(None)
    completed = False
    try:
        yield
        completed = True
    finally:
        executor = _kept.pop()
        if executor is not None:  # interrupted: the running jobs end on their own
            executor.shutdown(wait=completed, cancel_futures=True)


@contextlib.contextmanager
def watch(report: Callable[[int, int], None]) -> Iterator[None]:
    """Within the block, `report(done, total)` is called each time a worker finishes a job (a progress bar)."""
    _watchers.append(report)
    try:
        yield
    finally:
        _watchers.remove(report)


def _quiet() -> None:
    """A worker: no Ctrl-C of its own (the parent stops the pool), stderr to /dev/null."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _run(job: Callable[[], Any]) -> Any:
    try:
        return job()
    except Exception:  # noqa: BLE001 - the caller traces it again in-process, where the error is raised
        return None
