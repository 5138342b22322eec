"""The trace cache: traces kept in memory for the process and on disk across processes.

A trace depends only on what `keys.part_key` names (the model config, task, sequence length,
the recipe fields that shape that part, depth, batch size, the cuBLAS workspace size); its file
name (`keys.disk_name`) adds the anatomist, torch, transformers and peft versions (peft wraps the
traced model under LoRA) and a digest of every file the tracer imports or reads, so a changed
tracer, data file or library never reads an old trace.

On disk: one zlib-compressed pickle per trace in the user cache folder
(`platformdirs.user_cache_dir("anatomist")/traces`, or `$ANATOMIST_CACHE_DIR/traces`),
written to a temporary file and renamed into place (atomic: two processes writing the same
trace both leave a whole file), pruned least recently used first beyond `MAX_DISK_BYTES`. An unreadable
entry is ignored with a warning and traced again. The pickles hold only anatomist's own
plain types (`records.py`) and numpy arrays, and are read only from that private folder.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from anatomist.trace.engine.records import StepTrace
from anatomist.trace.store.keys import disk_name
from anatomist.user_cache import cache_root, write_atomically

MAX_MEMORY_ENTRIES = 256
"""Traces kept in memory per process (a bert-large trace is about 1 MB)."""
MAX_DISK_BYTES = 512 * 2**20
"""Size of the disk cache beyond which the least recently written traces are deleted."""
_SUFFIX = ".trace"

T = TypeVar("T")
_disk_enabled = os.environ.get("ANATOMIST_NO_CACHE", "") in ("", "0")


def set_disk_cache(enabled: bool) -> None:
    """Turn the disk cache on or off for this process (`--no-cache`; env ANATOMIST_NO_CACHE=1)."""
    global _disk_enabled
    _disk_enabled = enabled


def disk_cache_enabled() -> bool:
    return _disk_enabled


def cache_dir() -> Path:
    """Where traces are stored: `traces/` in anatomist's user cache folder (`user_cache.cache_root`)."""
    return cache_root() / "traces"


class Memo:
    """A bounded in-process table (least recently used out first): the traces themselves, and
    the arithmetic on them the planner repeats across recipes that share it. `clear_memory`
    empties every one."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._table: OrderedDict[Any, Any] = OrderedDict()
        _memos.append(self)

    def get(self, key: Any, compute: Callable[[], T]) -> T:
        if key in self._table:
            self._table.move_to_end(key)
            return self._table[key]  # type: ignore[no-any-return]
        value = self._table[key] = compute()
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)
        return value

    def __contains__(self, key: Any) -> bool:
        return key in self._table

    def clear(self) -> None:
        self._table.clear()


_memos: list[Memo] = []
_memory = Memo(MAX_MEMORY_ENTRIES)
"""The traces of this process."""


def get_or_trace(key: tuple[Any, ...], trace: Callable[[], T], kind: type[T] = StepTrace) -> T:  # type: ignore[assignment]
    """The trace of `key`: from memory, else from disk, else `trace()` (then stored in both).

    `kind`: the type of what is stored (a StepTrace, or another of anatomist's plain records
    derived from the model alone, such as the estimator's trace plan)."""

    def from_disk_or_trace() -> T:
        name = disk_name(key) + _SUFFIX if _disk_enabled else None
        found = _load(name, kind) if name is not None else None
        if found is None:
            found = trace()
            if name is not None:
                _store(name, found)
        return found

    return _memory.get(key, from_disk_or_trace)


def has(key: tuple[Any, ...]) -> bool:
    """Whether `get_or_trace(key, ...)` would not trace a StepTrace: it is in memory, or on disk (then
    loaded into memory)."""
    if key in _memory:
        return True
    found = _load(disk_name(key) + _SUFFIX) if _disk_enabled else None
    if found is not None:
        _memory.get(key, lambda: found)
    return found is not None


def find(key: tuple[Any, ...], kind: type[T]) -> T | None:
    """What `put` stored under `key` (in memory, else on disk, then loaded into memory), or None."""
    if key in _memory:
        return _memory.get(key, lambda: None)  # type: ignore[no-any-return]
    found = _load(disk_name(key) + _SUFFIX, kind) if _disk_enabled else None
    if found is not None:
        _memory.get(key, lambda: found)
    return found


def put(key: tuple[Any, ...], value: Any) -> None:
    """Store what was traced elsewhere (another process) as `get_or_trace` would have."""
    _memory.get(key, lambda: value)
    if _disk_enabled:
        _store(disk_name(key) + _SUFFIX, value)


def clear_memory() -> None:
    """Forget the traces held in this process, and what was derived from them (the disk cache stays)."""
    for memo in _memos:
        memo.clear()


def _load(name: str, kind: type[T] = StepTrace) -> T | None:  # type: ignore[assignment]
    path = cache_dir() / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn(f"cannot read the trace cache entry {path} ({exc}); tracing again")
        return None
    try:
        value = pickle.loads(zlib.decompress(data))
    except Exception as exc:  # noqa: BLE001 - any damage to the file means: trace again
        _warn(f"ignoring an unreadable trace cache entry {path} ({type(exc).__name__}); tracing again")
        return None
    if not isinstance(value, kind):
        _warn(f"ignoring a trace cache entry of the wrong type {path}; tracing again")
        return None
    with _suppress_os_errors():
        os.utime(path)  # pruning deletes the least recently used first
    return value


def _store(name: str, value: Any) -> None:
    folder = cache_dir()
    data = zlib.compress(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), 1)
    try:
        write_atomically(folder / name, data)
    except OSError as exc:
        _warn(f"cannot write the trace cache in {folder} ({exc}); continuing without it")
        return
    _prune(folder)


def _prune(folder: Path) -> None:
    """Delete the oldest traces while the folder holds more than MAX_DISK_BYTES."""
    entries = []
    for path in folder.glob("*" + _SUFFIX):
        try:
            stat = path.stat()
        except OSError:
            continue  # removed by another process meanwhile
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= MAX_DISK_BYTES:
            break
        path.unlink(missing_ok=True)
        total -= size


@contextlib.contextmanager
def _suppress_os_errors() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass


_warned: set[str] = set()


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"anatomist: warning: {message}", file=sys.stderr)
