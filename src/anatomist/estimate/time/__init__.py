"""The time of one training step, offline: op costs extrapolated from the traces (`ops`), each costed by a
roofline whose factors a calibration gives (`roofline`), summed into one device's step (`device`); across devices,
the collectives (`collectives`, over `network`), offload's copies (`transfers`) and the step they make
(`cluster.predict_time`). Names are imported from their modules: this package's import loads nothing."""
