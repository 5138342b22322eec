"""Measure real runs: device monitor, measured anatomy, Trainer callback, `track()`, profile.

The public names load lazily, so that `anatomist.measure.profile` does not pay for the
Trainer callback's imports.
"""

from typing import Any

__all__ = ["AnatomistCallback", "RunSummary", "track"]


def __getattr__(name: str) -> Any:
    if name == "AnatomistCallback":
        from anatomist.measure.callback import AnatomistCallback

        return AnatomistCallback
    if name == "RunSummary":
        from anatomist.measure.recorder import RunSummary

        return RunSummary
    if name == "track":
        from anatomist.measure.track import track

        return track
    raise AttributeError(name)
