"""What a trace keeps of a model: every stack cut to a number of blocks, or the layers a `Cut` names.

Plain data (no torch): a trace's key holds its depth, `configs.cut_config` cuts a config to it, and
`plan` chooses which depths to trace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CutStack:
    """The layers one stack keeps."""

    fields: tuple[str, ...]
    """The config fields that hold this stack's depth (one stack may be several ModuleLists of one depth)."""
    depth: int
    """The stack's depth in the full model."""
    kept: tuple[int, ...]
    """Layer indices of the full model kept, ascending."""


@dataclass(frozen=True, slots=True)
class Cut:
    """A model cut to some of its layers, by index: hashable, and all `configs.cut_config` needs."""

    stacks: tuple[CutStack, ...]

    @property
    def blocks(self) -> int:
        return sum(len(s.kept) for s in self.stacks)


Depth = int | Cut | None
"""What a trace keeps of the model: every stack cut to that many blocks (int), the layers a `Cut`
names, or the whole model (None)."""
