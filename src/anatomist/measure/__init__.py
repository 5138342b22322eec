"""Measure real runs: device monitor, measured anatomy, Trainer callback, `track()`."""

from anatomist.measure.callback import AnatomistCallback
from anatomist.measure.recorder import RunSummary, mfu_inputs
from anatomist.measure.track import track

__all__ = ["AnatomistCallback", "RunSummary", "mfu_inputs", "track"]
