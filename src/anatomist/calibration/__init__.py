"""The time model's calibration: which factors a prediction uses (`lookup`: read at estimate time), and how they
are fitted (`fit`, shared by the two sources): to steps measured on one GPU (`measured`, from `anatomist bench`
rows: `bench/calibrate.py`) and to published training runs (`published`, benchmarks/published/fit.py)."""
