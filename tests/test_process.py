"""The `anatomist` process itself: the few tests that need a fresh interpreter.

Every other CLI test calls `anatomist.cli.main(argv)` in-process (the `cli` fixture in
conftest.py), which checks the same exit codes and output in a fraction of the time. These
stay subprocesses because what they test only exists in a real process:

- bad input: the exit status a shell sees, and a stderr of exactly one line with no traceback,
  including anything that torch or transformers print while they are imported (in-process,
  pytest's capture and warning filters would hide that);
- the installed console script (`anatomist`, from [project.scripts]) starts and answers;
- `--help`, a bad flag, an unknown GPU or model, `gpus` and `models` import neither torch nor
  transformers (sys.modules of a fresh interpreter: in-process, the test session has imported
  both long before);
- `anatomist bench` survives SIGKILL: the test kills the process group mid-suite, then resumes;
- the process ends without the interpreter's teardown (`cli.run`) but still runs the exit handlers,
  waits for a thread that has not finished and keeps the exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_tiny import write_tiny_suite

from anatomist import __version__


def _anatomist(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anatomist", *args], capture_output=True, text=True,
                          env=os.environ.copy(), timeout=timeout_s)


def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    proc = _anatomist("report", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"anatomist: error: results file {tmp_path / 'missing.jsonl'} does not exist"


def test_bad_model_config_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    """A config that transformers parses and we refuse: nothing else reaches stderr on the way."""
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": -3}')
    proc = _anatomist("estimate", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("anatomist: error:") and "field hidden_size must be a positive integer" in line


IMPORTS_SEEN = (
    "import sys\n"
    "from anatomist.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit:\n"
    "    pass\n"
    "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n"
)


@pytest.mark.parametrize("argv", [["estimate", "--help"], ["profile", "--help"], ["estimate", "--fsdp", "hybrid"],
                                  ["estimate", "--zero-stage", "9"], ["gpus", "--json"], ["models"],
                                  ["estimate", "--gpu", "V100"], ["plan", "no-such-model", "--gpu", "T4"]],
                         ids=["estimate-help", "profile-help", "bad-choice", "bad-stage", "gpus", "models", "unknown-gpu",
                              "unknown-model"])
def test_help_bad_flags_gpus_and_models_import_neither_torch_nor_transformers(argv: list[str]) -> None:
    """The recipe flags are generated from the Recipe dataclass without transformers' HfArgumentParser."""
    proc = subprocess.run([sys.executable, "-c", IMPORTS_SEEN, *argv], capture_output=True, text=True,
                          env=os.environ.copy(), timeout=300)
    assert proc.stderr.strip().splitlines()[-1] == "heavy: []", proc.stderr


@pytest.mark.slow
def test_a_repeated_estimate_and_a_bad_recipe_value_import_neither_torch_nor_transformers(tiny_model,
                                                                                      tmp_path: Path) -> None:
    """The trace cache holds the traces, the model's plan and what the estimate reads of the config;
    TrainingArguments' defaults are kept per transformers version: the second run reads them all."""
    env = {**os.environ, "ANATOMIST_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["estimate", str(tiny_model("llama")), "--seq-len", "32", "--bf16", "--gpu", "A100-80GB", "--json"]

    def heavy(args: list[str]) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", IMPORTS_SEEN, *args], capture_output=True, text=True,
                              env=env, timeout=300)
        return proc.stderr.strip().splitlines()[-1:]

    assert heavy(argv) == ["heavy: ['torch', 'transformers']"]  # the first traces the model
    assert heavy(argv) == ["heavy: []"]
    assert heavy([*argv, "--batch-size", "0"]) == ["heavy: []"]


def test_an_estimate_that_imports_bitsandbytes_prints_nothing_on_stderr(tiny_model, tmp_path: Path) -> None:
    """bitsandbytes logs "Failed to load CPU gemm_4bit_forward" on import where the CPU has AVX-512 BF16 (this
    machine's does); the 8-bit optimizer's trace imports it, in a forked worker: the command keeps it quiet."""
    env = {**os.environ, "ANATOMIST_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["estimate", str(tiny_model("llama")), "--seq-len", "32", "--optim", "adamw_bnb_8bit", "--json"]
    proc = subprocess.run([sys.executable, "-m", "anatomist", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and proc.stderr == ""


def test_console_script_version() -> None:
    script = Path(sys.executable).with_name("anatomist")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}: anatomist is not installed in this environment")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"anatomist {__version__}"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


@pytest.mark.slow  # real training steps in subprocesses: minutes on 2 cores
def test_bench_sigkill_loses_no_finished_row_and_resume_continues(tmp_path: Path) -> None:
    results = tmp_path / "r.jsonl"
    suite = write_tiny_suite(tmp_path)
    cmd = [sys.executable, "-m", "anatomist", "bench", "--suite", str(suite), "--results", str(results), "--json"]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if results.exists() and len(results.read_text().splitlines()) >= 2:
                break
            if proc.poll() is not None:
                pytest.fail("bench ended before it could be killed")
            time.sleep(0.05)
        else:
            pytest.fail("no row written within 120 s")
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and its worker, mid-suite
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    survived = _rows(results)
    assert survived and survived[0]["name"] == "first" and survived[0]["status"] == "ok"
    assert len(survived) < 3  # killed before the end
    done = subprocess.run(cmd + ["--resume"], env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    final = _rows(results)
    assert [r["name"] for r in final] == ["first", "needs-gpu", "accum"]  # no row twice
    assert final[0] == survived[0]
    assert [r["name"] for r in json.loads(done.stdout)["rows"]] == ["first", "needs-gpu", "accum"]


EXIT_SEEN = (
    "import atexit, sys, threading, time\n"
    "from pathlib import Path\n"
    "import anatomist.cli as cli\n"
    "folder = Path(sys.argv[1])\n"
    "def work():\n"
    "    time.sleep(0.5)\n"
    "    (folder / 'thread').write_text('done')\n"
    "class Teardown:\n"
    "    def __del__(self):\n"
    "        (folder / 'teardown').write_text('done')  # the interpreter's teardown ran\n"
    "kept = Teardown()\n"
    "if sys.argv[3] == 'no-private-exit':\n"
    "    del atexit._run_exitfuncs\n"
    "def main():\n"
    "    atexit.register(lambda: (folder / 'atexit').write_text('done'))\n"
    "    if sys.argv[2] == 'thread':\n"
    "        threading.Thread(target=work).start()\n"
    "    print('buffered output', end='')\n"
    "    return 3\n"
    "cli.main = main\n"
    "cli.run()\n"
)


@pytest.mark.parametrize(("thread", "exit_path", "teardown"), [
    ("thread", "default", True),  # a running thread: the normal exit waits for it
    ("no-thread", "default", False),  # the fast exit
    ("no-thread", "ANATOMIST_NORMAL_EXIT=1", True),  # opted out
    ("no-thread", "no-private-exit", True),  # an interpreter without CPython's atexit._run_exitfuncs
])
def test_fast_exit_runs_exit_handlers_and_waits_for_threads(tmp_path: Path, thread: str, exit_path: str,
                                                              teardown: bool) -> None:
    env = {**os.environ, "ANATOMIST_NORMAL_EXIT": "1" if exit_path.startswith("ANATOMIST") else ""}
    proc = subprocess.run([sys.executable, "-c", EXIT_SEEN, str(tmp_path), thread, exit_path], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 3 and proc.stdout == "buffered output", proc.stderr
    assert (tmp_path / "atexit").read_text() == "done"
    assert (tmp_path / "thread").exists() == (thread == "thread")
    assert (tmp_path / "teardown").exists() == teardown
