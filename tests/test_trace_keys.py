"""The trace key's digest covers every file a trace depends on: a file the tracer imports or reads
that `keys.TRACE_SOURCES` leaves out would let the disk cache serve traces of the old code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anatomist.trace.store import keys

T5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 32, "d_ff": 64, "d_kv": 8,
      "num_heads": 4, "num_layers": 8, "num_decoder_layers": 2, "vocab_size": 100, "decoder_start_token_id": 0,
      "pad_token_id": 0, "eos_token_id": 1}
"""Encoder and decoder of different depths: a plan by kind, whose cuts are built and checked (`stack.cut_matches`)."""


@pytest.mark.slow
def test_every_file_a_trace_loads_is_in_the_digest(tiny_model, tmp_path: Path) -> None:
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps(T5))
    script = Path(__file__).parent / "truth" / "trace_loads.py"
    env = {**os.environ, "ANATOMIST_CACHE_DIR": str(tmp_path / "cache"), "ANATOMIST_JOBS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model("llama")), str(t5)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout))
    assert "trace/step/driver.py" in loaded and "data/cuda_autocast.toml" in loaded  # the script did trace
    assert loaded - set(keys.TRACE_SOURCES) == set()


def test_the_digest_changes_with_any_source(monkeypatch, tmp_path: Path) -> None:
    """Each listed file is read into the digest (a data file edited is a new digest, not only code)."""
    package = Path(keys.__file__).parents[2]
    before = keys.code_digest()
    real = Path.read_bytes

    def edited(path: Path) -> bytes:
        data = real(path)
        return data + b"#" if path == package / "data" / "cuda_autocast.toml" else data

    keys.code_digest.cache_clear()
    monkeypatch.setattr(Path, "read_bytes", edited)
    try:
        assert keys.code_digest() != before
    finally:
        monkeypatch.undo()
        keys.code_digest.cache_clear()


def test_a_model_keys_its_traces_alike_cold_and_warm(tmp_path: Path) -> None:
    """A first process reads a model's facts through transformers, the next from the cache: both must key the
    same traces (transformers writes rope_theta into the rope_parameters dict it is handed; a key taken after
    that made the first repeated estimate trace everything again)."""
    script = "from anatomist.workload_loader import load_workload; print(repr(load_workload('Llama-3.2-1B').trace_key()))"
    env = {**os.environ, "ANATOMIST_CACHE_DIR": str(tmp_path / "cache")}
    keys = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True,
                           timeout=300).stdout for _ in range(2)]
    assert keys[0] and keys[0] == keys[1]
