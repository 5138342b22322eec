"""How many GPUs, on how many nodes: `plan --max-nodes N` plans each cluster size and chooses one.

The sizes tried (`cluster_sizes`) are the powers of two up to one node's GPUs on one node, then
2, 3, ... whole nodes up to the maximum. Each size is searched on its own (every sharding that size
allows, the network between nodes where there are several) for its pick alone (`search.fastest_fitting`:
the memory of the recipes too slow to be it is never predicted); the chosen size is then planned in full
(`search.plan`). A size the global batch does not split over, or on which nothing fits, is kept with the
reason.

The choice is the size with the most samples/s per GPU (what a GPU-hour buys), fewer GPUs on a
tie (within `SPEED_TIE`): more GPUs always give more samples/s in all, until communication eats
it, so "fastest" alone would always answer the largest cluster. The table shows every size's
samples/s, so a reader who pays for time rather than GPU-hours picks another row.

FSDP is traced at the two smallest world sizes and derived at the others (`trace.depth.worlds`: exact where no shard
is padded), and one set of worker processes traces for every size.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anatomist.errors import InputError
from anatomist.plan.candidates import SPEED_TIE, Candidate
from anatomist.plan.search import Plan
from anatomist.plan.space import SearchSpace
from anatomist.trace.store import parts, pool


@dataclass(frozen=True, slots=True)
class Cluster:
    """One cluster size searched: its pick, or why it has none; the chosen size's plan."""

    num_gpus: int
    nodes: int
    best: Candidate | None
    why_not: str | None = None
    plan: Plan | None = None
    """The full plan (Pareto front, reasons), of the chosen size only."""

    @property
    def samples_per_gpu(self) -> float:
        return self.best.samples_per_second / self.num_gpus if self.best else 0.0

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"num_gpus": self.num_gpus, "nodes": self.nodes, "fits": best is not None, "why_not": self.why_not,
                "samples_per_second": best.samples_per_second if best else None,
                "samples_per_second_per_gpu": self.samples_per_gpu if best else None,
                "device_total_bytes": best.device_total if best else None,
                "recipe": best.recipe.to_dict() if best else None}


def cluster_sizes(gpus_per_node: int, max_nodes: int) -> list[tuple[int, int]]:
    """(GPUs in all, nodes): powers of two up to `gpus_per_node` on one node (and one full node), then 2, 3, ...
    `max_nodes` full nodes."""
    if gpus_per_node < 1 or max_nodes < 1:
        raise InputError(f"--gpus and --max-nodes must be at least 1, got {gpus_per_node} and {max_nodes}")
    one_node = sorted({*(2**k for k in range(gpus_per_node.bit_length()) if 2**k <= gpus_per_node), gpus_per_node})
    return [(g, 1) for g in one_node] + [(gpus_per_node * n, n) for n in range(2, max_nodes + 1)]


def plan_clusters(space: SearchSpace, sizes: list[tuple[int, int]], plan_one: Callable[[SearchSpace], Plan],
                  best_one: Callable[[SearchSpace], Candidate],
                  on_size: Callable[[int, int], None] = lambda g, n: None) -> tuple[list[Cluster], Cluster]:
    """Search `space` at each of `sizes` for its pick (`best_one`: `Plan.best` of `plan_one`, found with less
    work); every Cluster, and the chosen one with its plan (`plan_one`) (module docstring).

    Raises:
        InputError: no size has a recipe that fits (each size's reason in the message).
    """
    clusters = []
    with pool.kept(), _derived_worlds(sizes):
        for num_gpus, nodes in sizes:
            on_size(num_gpus, nodes)
            try:
                sized = dataclasses.replace(space, num_gpus=num_gpus, nodes=nodes)
                clusters.append(Cluster(num_gpus, nodes, best_one(sized)))
            except InputError as exc:  # the global batch does not split over it, or nothing fits
                clusters.append(Cluster(num_gpus, nodes, None, str(exc).splitlines()[0]))
        fitting = [c for c in clusters if c.best is not None]
        if not fitting:
            raise InputError("no cluster size has a recipe that fits: "
                             + "; ".join(f"{c.num_gpus} GPU(s): {c.why_not}" for c in clusters))
        top = max(c.samples_per_gpu for c in fitting)
        chosen = next(c for c in fitting if c.samples_per_gpu >= top / (1 + SPEED_TIE))  # fewest GPUs among the ties
        planned = dataclasses.replace(chosen, plan=plan_one(dataclasses.replace(space, num_gpus=chosen.num_gpus,
                                                                                 nodes=chosen.nodes)))
    return [planned if c is chosen else c for c in clusters], planned


def _derived_worlds(sizes: list[tuple[int, int]]) -> contextlib.AbstractContextManager[None]:
    """FSDP traced at the two smallest world sizes of `sizes`, the others derived from them (`trace.depth.worlds`),
    where there are more than two."""
    worlds = sorted({num_gpus for num_gpus, _ in sizes if num_gpus > 1})
    return parts.worlds_derived_from(*worlds[:2]) if len(worlds) > 2 else contextlib.nullcontext()
