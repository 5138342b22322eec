"""The allocation curves of a plan's traced cuts, extrapolated to the full model at any batch size.

Within one cut the traces at the two batch sizes (`traces.TRACE_BATCHES`) run the same ops, so their curves are
extrapolated point by point to the wanted batch; then segment by segment, and in the blocks block by block, to the
full model (`TracePlan.combine`). The caching allocator's reserve does not extrapolate block by block: the ratio of
peak reserved to peak allocated of the deepest, largest trace is applied to the extrapolated peak instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anatomist.anatomy import TENSOR_CATEGORIES, MemoryCategory, Phase
from anatomist.estimate.traces import TRACE_BATCHES, StepTraces, affine
from anatomist.trace.depth.cuts import Depth
from anatomist.trace.depth.plan import TracePlan
from anatomist.trace.engine.records import Curves, PhasePeak


@dataclass(slots=True)
class ExtrapolatedCurves:
    """The traces of a plan's cuts at two batch sizes, and how to extrapolate them to the full model."""

    traces: StepTraces

    @property
    def plan(self) -> TracePlan:
        return self.traces.plan

    def state_bytes(self) -> int:
        optimizer = self.traces.optimizer
        if optimizer is None:
            return 0
        return round(self.plan.combine(lambda c: optimizer[c].static_bytes.get(MemoryCategory.OPTIMIZER_STATES, 0)))

    def phases(self) -> list[Phase]:
        phases = list(self.traces.passes[self.plan.base, TRACE_BATCHES[0]].phases)
        return phases + ([Phase.OPTIMIZER] if self.traces.optimizer else [])

    def phase_at(self, phase: Phase, batch: int, counted: np.ndarray | None = None) -> PhasePeak:
        """The peak of `phase` of the full model at `batch` samples per pass.

        Per cut, the batch-2 and batch-3 curves are extrapolated point by point to `batch`.
        Then, segment by segment (in the blocks, block by block: each block of the base with the
        same block of each other cut), the points of the base are matched with the same points of
        the other cuts and extrapolated point by point to the full model (`TracePlan.combine`);
        the peak is the highest point. Where a segment's points do not match up, its peaks are
        extrapolated instead.

        `counted` (one share per `TENSOR_CATEGORIES`; None: all of each) is how much of each category of a point
        stays on a device once the step is sharded (`sharding.counted_shares`): the peak is the point highest in what
        stays, which under ZeRO need not be the highest traced point (its gradients or gathered weights are replaced).
        """
        points, ratio = self._points(phase, batch)
        best, best_allocated, best_categories = -np.inf, -1.0, None
        keys = [k for k in points[self.plan.base][0].index if k[0] is phase]
        for key in keys:
            allocated, categories = self._segment(points, key)
            stays = allocated if counted is None else allocated - categories @ (1.0 - counted)
            i = int(np.argmax(stays))
            if stays[i] > best:
                best, best_allocated, best_categories = float(stays[i]), float(allocated[i]), categories[i]
        return self._peak(phase, best_allocated, best_categories, ratio)

    def segment_peaks(self, phase: Phase, batch: int) -> dict[tuple[Phase, str, int, int], PhasePeak]:
        """The highest point of each segment of `phase` (in the blocks, of each block of the base cut), on the
        full model at `batch` samples per pass: the points `phase_at` takes the highest of."""
        points, ratio = self._points(phase, batch)
        peaks = {}
        for key in [k for k in points[self.plan.base][0].index if k[0] is phase]:
            allocated, categories = self._segment(points, key)
            i = int(np.argmax(allocated))
            peaks[key] = self._peak(phase, float(allocated[i]), categories[i], ratio)
        return peaks

    def _points(self, phase: Phase, batch: int) -> tuple[dict[Depth, tuple[Curves, np.ndarray, np.ndarray]], float]:
        """Each cut's curve of `phase` at `batch` (its keys, allocated, categories), and the reserve ratio."""
        optimizer = self.traces.optimizer
        if phase is Phase.OPTIMIZER and optimizer is not None:
            points = {c: (optimizer[c].curves, optimizer[c].curves.allocated, optimizer[c].curves.categories)
                      for c in self.plan.cuts}
            return points, optimizer[self.plan.deepest].curves.reserve_ratio
        points = {c: self._at_batch(c, batch) for c in self.plan.cuts}
        return points, self.traces.passes[self.plan.deepest, TRACE_BATCHES[1]].curves.reserve_ratio

    def _peak(self, phase: Phase, allocated: float, categories: np.ndarray | None, ratio: float) -> PhasePeak:
        """A point of the full model's curve as a PhasePeak: the reserve and the optimizer states added."""
        peak = PhasePeak.from_vector(allocated, categories if categories is not None else [0.0] * len(TENSOR_CATEGORIES))
        # Fragmentation does not extrapolate block by block; its ratio to the peak does, roughly.
        peak.reserved = max(peak.allocated, round(peak.allocated * ratio))
        if phase is not Phase.OPTIMIZER:
            states = self.state_bytes()  # alive, unchanged, through forward and backward
            peak.categories[MemoryCategory.OPTIMIZER_STATES] += states
            peak.allocated += states
            peak.reserved += states
        return peak

    def _segment(
        self, points: dict[Depth, tuple[Curves, np.ndarray, np.ndarray]], key: tuple[Phase, str, int, int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The points of one segment (one block, in the blocks) of the base, extrapolated to the full model."""
        k0, a0, c0 = points[self.plan.base]
        i0 = k0.index[key]
        matched = []
        for delta in self.plan.deltas:
            curves, a, c = points[delta.cut]
            phase, segment, micro, block = key
            i = curves.index.get((phase, segment, micro, delta.aligned(block) if block >= 0 else block))
            matched.append((delta.multiplier, i, a, c))
        if all(i is not None and len(i) == len(i0) for _, i, _, _ in matched):
            allocated, categories = a0[i0].copy(), c0[i0].copy()
            for m, i, a, c in matched:
                allocated += m * (a[i] - a0[i0])
                categories += m * (c[i] - c0[i0])
            return allocated, categories
        # No point-wise match: extrapolate the segment's peak (a cut without the segment adds nothing).
        j0 = i0[np.argmax(a0[i0])]
        allocated, categories = a0[j0:j0 + 1].copy(), c0[j0:j0 + 1].copy()
        for m, i, a, c in matched:
            if i is not None and len(i):
                j = i[np.argmax(a[i])]
                allocated += m * (a[j] - a0[j0])
                categories += m * (c[j:j + 1] - c0[j0:j0 + 1])
        return allocated, categories

    def _at_batch(self, cut: Depth, batch: int) -> tuple[Curves, np.ndarray, np.ndarray]:
        """The cut's curve (its points' keys, allocated, categories) extrapolated to `batch` samples."""
        lo, hi = (self.traces.passes[cut, b].curves for b in TRACE_BATCHES)
        if lo.keys != hi.keys:
            raise RuntimeError(
                f"the traced op sequence changed between batch {TRACE_BATCHES[0]} and {TRACE_BATCHES[1]}; "
                "cannot extrapolate in batch size"
            )
        allocated = affine(lo.allocated, hi.allocated, batch, TRACE_BATCHES[0])
        categories = affine(lo.categories, hi.categories, batch, TRACE_BATCHES[0])
        return lo, allocated, categories
