"""Shared fixtures: tiny model configs written to disk (tests never touch the network), and the CLI in-process."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The trace cache of a test run lives in a folder of its own, never in the user's cache.
os.environ.setdefault("ANATOMIST_CACHE_DIR", tempfile.mkdtemp(prefix="anatomist-test-cache-"))
# torch's CPU threads are OpenMP threads, which busy-wait for work by default. On a CPU shared
# with other jobs they spin against each other: a real step of a 3-layer BERT took 3-23 s
# instead of 0.4-0.6 s on the 2-core test machine under load. PASSIVE makes idle threads sleep;
# the thread count is unchanged. Read when torch loads libgomp, so it is set before any test
# module imports torch; the bench workers and CLI subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TINY_CONFIGS: dict[str, dict] = {
    "bert": {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 128,
        "type_vocab_size": 2, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "pad_token_id": 0,
    },
    "gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 4, "n_head": 4,
        "n_positions": 128, "vocab_size": 1000,
    },
    "llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 128, "tie_word_embeddings": False,
    },
}


def write_config(folder: Path, name: str, **overrides: object) -> Path:
    """Write a tiny config.json for `name` (a key of TINY_CONFIGS) and return its folder."""
    target = folder / name
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({**TINY_CONFIGS[name], **overrides}))
    return target


def refused_in_one_line(result, message: str) -> None:
    """A CLI run (the `cli` fixture's result) refused with exit code 2 and `message` in its one line on stderr."""
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


GQA_SEQ, GQA_HEADS, GQA_KV_HEADS, GQA_HEAD_DIM, GQA_BLOCKS = 64, 4, 2, 16, 2
"""The sequence and shape of `gqa_llama`."""


@pytest.fixture
def gqa_llama(tmp_path: Path):
    """A 2-block Llama with grouped-query heads (4 query heads, 2 key/value heads), read at 64 tokens: (its config's
    folder, its Workload)."""
    from anatomist.workload_loader import load_workload

    path = write_config(tmp_path, "llama", hidden_size=GQA_HEADS * GQA_HEAD_DIM, intermediate_size=128,
                        num_attention_heads=GQA_HEADS, num_key_value_heads=GQA_KV_HEADS, num_hidden_layers=GQA_BLOCKS,
                        vocab_size=500)
    return path, load_workload(str(path), seq_len=GQA_SEQ)


@pytest.fixture
def tiny_model(tmp_path: Path):
    """Factory: tiny_model("bert", num_hidden_layers=2) -> path of a config folder."""

    def make(name: str, **overrides: object) -> Path:
        return write_config(tmp_path, name, **overrides)

    return make


@pytest.fixture
def cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A trace cache of the test's own, on disk and empty in memory; its folder of traces."""
    from anatomist.trace.store import cache

    monkeypatch.setenv("ANATOMIST_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    cache.set_disk_cache(True)
    yield cache.cache_dir()
    cache.clear_memory()


def stored_kinds(folder: Path) -> dict[str, int]:
    """How many entries of each type the trace cache folder holds (StepTrace, ModelPlan, ModelFacts)."""
    import pickle
    import zlib
    from collections import Counter

    return dict(Counter(type(pickle.loads(zlib.decompress(p.read_bytes()))).__name__ for p in folder.glob("*.trace")))


@dataclass(frozen=True, slots=True)
class CliResult:
    """What a shell would see from `anatomist ARGS`: the exit code and the two streams."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """Run `anatomist ARGS` in this process: cli("estimate", "--json") -> CliResult.

    Calls the console script's entry point, `anatomist.cli.main(argv)`, with stdout and stderr
    captured (the rich consoles are built on the current sys.stdout at each call). argparse's
    exits (--help, --version, bad flags) become the return code, as in a shell. An unexpected
    exception is not turned into code 1: it propagates and fails the test with its traceback.
    Process behaviour itself (exit status, no traceback, the console script) is tested with
    real subprocesses in test_process.py.
    """
    from anatomist.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()  # start clean: nothing printed before this call
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help/--version exit 0, a bad flag exits 2
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:  # sys.exit("message"): the interpreter prints it and exits 1
                print(exc.code, file=sys.stderr)
                code = 1
        out, err = capsys.readouterr()
        return CliResult(returncode=code, stdout=out, stderr=err)

    return run
