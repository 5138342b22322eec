"""Estimates and plans run in one worker thread; the page polls a job for its progress and answer.

A cold trace takes seconds to a minute; the event loop never waits for it: a request submits a job
and gets its id, and `/api/jobs/ID` says how far it is. One worker, not several: a job already
traces side by side in processes of its own (`trace.store.pool`, one per core), and the trace pool's
progress hooks and kept workers are the process's, not a thread's. Jobs are shared by their
form's key, so a link opened twice, or a result asked again, is one job; the last MAX_KEPT are kept
with their answers (and charts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from anatomist.errors import InputError

log = logging.getLogger("anatomist.web")

MAX_KEPT = 64
"""Finished jobs kept with their answers (a plan's view is ~100 KB)."""
MAX_WAITING = 8
"""Jobs queued or running at once; more is refused (HTTP 503) rather than queued for minutes."""
INTERNAL_ERROR = ("the server could not compute this (an internal error, logged on the server): try another setting, "
                  "or run `{command}` on your own machine, where the traceback says what failed")

Status = Literal["queued", "running", "done", "error"]
Work = Callable[[Callable[[int, int], None]], dict[str, Any]]
"""A job's work: called with its progress callback, returns the page's view."""


class Busy(Exception):
    """MAX_WAITING jobs are already waiting."""


@dataclass(kw_only=True, slots=True)
class Job:
    id: str
    key: str
    status: Status = "queued"
    traced: int = 0
    to_trace: int = 0
    submitted_s: float = field(default_factory=time.monotonic)
    started_s: float | None = None
    finished_s: float | None = None
    view: dict[str, Any] | None = None
    error: str | None = None
    internal: bool = False
    """The error is an unexpected exception (HTTP 500), not bad input (400)."""
    cache: dict[str, Any] = field(default_factory=dict)
    """What was derived from the view on request (chart PNGs), by name."""
    future: Future[None] | None = None

    def to_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        started = self.started_s or now
        return {
            "id": self.id, "status": self.status, "traced": self.traced, "to_trace": self.to_trace,
            "waited_s": round(started - self.submitted_s, 3),
            "elapsed_s": round((self.finished_s or now) - started, 3) if self.started_s else 0.0,
            "view": self.view, "error": self.error,
        }


class JobRunner:
    """The worker thread and the jobs it ran, by id and by key."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anatomist-job")
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._by_key: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._warm: Future[None] | None = None
        self._closed = False

    def submit(self, key: str, work: Work, command: str = "anatomist ...") -> Job:
        """The job for `key`: the one queued, running or done, else a new one queued (an error is never
        reused: what it depended on, an upload, the Hub, may be there now). `command`: the command line the
        request means, which an internal error advises to run.

        Raises:
            Busy: MAX_WAITING jobs are queued or running.
        """
        with self._lock:
            job = self._by_key.get(key)
            if job is not None and job.status != "error":
                self._jobs.move_to_end(job.id)
                return job
            if sum(j.status in ("queued", "running") for j in self._jobs.values()) >= MAX_WAITING:
                raise Busy(f"{MAX_WAITING} requests are already waiting; try again in a minute")
            job = Job(id=secrets.token_urlsafe(9), key=key)
            self._jobs[job.id] = job
            self._by_key[key] = job
            self._forget_old()
            job.future = self._executor.submit(self._run, job, work, command)
            return job

    def warm_up(self, work: Callable[[], None]) -> None:
        """Queue `work` ahead of any job: the imports every later call relies on (its failure is logged,
        not raised). `ready()` waits for it."""
        def quietly() -> None:
            try:
                work()
            except Exception:  # noqa: BLE001 - the first request will say what is wrong
                if not self._closed:  # stopped while importing: the interpreter's shutdown breaks imports
                    log.exception("warm-up failed")
        self._warm = self._executor.submit(quietly)

    async def ready(self) -> None:
        """Return once the warm-up is over. Library calls made outside the worker thread wait for it:
        transformers' lazy imports are not safe from two threads at once."""
        if self._warm is not None and not self._warm.done():
            await asyncio.wrap_future(self._warm)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    async def wait(self, job: Job, timeout_s: float) -> None:
        """Return when `job` is finished or after `timeout_s`, whichever is first (the job goes on)."""
        if job.future is None or timeout_s <= 0:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), timeout_s)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self, job: Job, work: Work, command: str) -> None:
        job.status, job.started_s = "running", time.monotonic()

        def progress(done: int, total: int) -> None:
            job.traced, job.to_trace = done, total

        try:
            job.view = work(progress)
            job.status = "done"
        except InputError as exc:
            job.error, job.status = str(exc), "error"
        except Exception:  # noqa: BLE001 - one generic line for the page, the traceback in the server's log
            log.exception("job %s (%s) failed", job.id, job.key)
            job.error, job.status, job.internal = INTERNAL_ERROR.format(command=command), "error", True
        finally:
            job.finished_s = time.monotonic()

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.status in ("done", "error")]
        for old in finished[: max(0, len(finished) - MAX_KEPT)]:
            del self._jobs[old.id]
            if self._by_key.get(old.key) is old:
                del self._by_key[old.key]
