"""A model of PyTorch's CUDA caching allocator, replayed over a trace's alloc/free events.

It turns the live-tensor bytes of a trace into what `torch.cuda.max_memory_allocated` and
`max_memory_reserved` report: sizes are rounded, blocks are carved out of cached segments
best-fit, split and merged, and segments are never returned to the driver unless an
allocation would not fit otherwise.

Constants and rules are those of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, default
settings: no expandable segments, no max_split_size):
  kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer 2 MiB, kLargeBuffer 20 MiB,
  kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB.

Streams: each cached block belongs to the stream it was first allocated on, and a free block is handed out
again only to a request of that stream (the allocator's pools are keyed by stream), so what FSDP2 allocates on
its all-gather and reduce-scatter streams is reserved apart from what the compute stream frees. Known
limitations: no `roundup_power2_divisions`; blocks freed while a different stream uses them are treated as free
at once (FSDP2 keeps its buffers alive until the stream that uses them is done, so few are).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512
SMALL_SIZE_BYTES = 1 << 20
SMALL_BUFFER_BYTES = 2 << 20
LARGE_BUFFER_BYTES = 20 << 20
MIN_LARGE_ALLOC_BYTES = 10 << 20
ROUND_LARGE_BYTES = 2 << 20


def round_size(nbytes: int) -> int:
    """Requested bytes rounded up to a multiple of 512 (at least 512)."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_size(rounded: int) -> int:
    """Bytes asked of cudaMalloc when no cached block fits a request of `rounded` bytes."""
    if rounded <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass(eq=False, slots=True)
class _Block:
    addr: int
    size: int
    small: bool
    segment: int
    stream: int = 0
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False


@dataclass(slots=True)
class CachingAllocator:
    """Replays malloc/free; `allocated` and `reserved` mirror torch.cuda's statistics."""

    capacity_bytes: int | None = None
    """Device memory the allocator may reserve; None for unlimited."""
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    oom: bool = False
    """True once a request could not be served even after releasing cached segments."""
    _pools: dict[tuple[int, bool], list[tuple[int, int, _Block]]] = field(default_factory=dict)
    """The free blocks by (stream, small), by size then address."""
    _segments: dict[int, tuple[int, _Block]] = field(default_factory=dict)  # id -> (size, first block)
    _next_addr: int = 0
    _seg_ids: itertools.count = field(default_factory=itertools.count)

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        """A block of `nbytes` for a request on `stream` (0: the compute stream)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE_BYTES
        block = self._take_free(size, small, stream)
        if block is None:
            block = self._new_segment(size, small, stream)
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK_BYTES) or (not small and remaining > SMALL_SIZE_BYTES):
            rest = _Block(block.addr + size, remaining, small, block.segment, block.stream, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert_free(block)

    # -- pools --------------------------------------------------------------------
    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._pools.setdefault((block.stream, block.small), []), (block.size, block.addr, block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._pools[(block.stream, block.small)]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        del pool[i]

    def _take_free(self, size: int, small: bool, stream: int) -> _Block | None:
        pool = self._pools.get((stream, small), [])
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = pool.pop(i)[2]
        return block

    def _new_segment(self, size: int, small: bool, stream: int) -> _Block:
        seg_bytes = segment_size(size)
        if self.capacity_bytes is not None and self.reserved + seg_bytes > self.capacity_bytes:
            self._release_free_segments()
            if self.reserved + seg_bytes > self.capacity_bytes:
                self.oom = True
        seg = next(self._seg_ids)
        block = _Block(self._next_addr, seg_bytes, small, seg, stream)
        self._next_addr += seg_bytes
        self._segments[seg] = (seg_bytes, block)
        self.reserved += seg_bytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _release_free_segments(self) -> None:
        """What the allocator does before reporting OOM: give back wholly free segments."""
        for pool_key, pool in self._pools.items():
            keep = []
            for entry in pool:
                block = entry[2]
                seg_bytes, _ = self._segments[block.segment]
                if block.prev is None and block.next is None and block.size == seg_bytes:
                    self.reserved -= seg_bytes
                    del self._segments[block.segment]
                else:
                    keep.append(entry)
            self._pools[pool_key] = keep
