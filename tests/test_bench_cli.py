"""`anatomist bench` end to end on CPU: real Trainer rows, bad input, SIGKILL durability."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from bench_tiny import write_tiny_suite

from anatomist.cli import main


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_unknown_suite_row_model_exit_2(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    assert main(["bench", "--suite", "nope", "--results", str(results)]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    assert main(["bench", "--rows", "vanilla,bogus", "--results", str(results)]) == 2
    assert "unknown row(s) bogus" in capsys.readouterr().err
    assert main(["bench", "--model", "no-such-model", "--results", str(results)]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["bench", "--num-processes", "2", "--results", str(results)]) == 2
    assert not results.exists()


def test_corrupt_results_file_exit_2_and_untouched(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    results.write_text('{"anatomist_results": 1}\n{"broken"\n')
    before = results.read_bytes()
    assert main(["bench", "--suite", str(write_tiny_suite(tmp_path)), "--results", str(results)]) == 2
    assert "line 2 is corrupt" in capsys.readouterr().err
    assert results.read_bytes() == before


def test_tiny_suite_runs_through_trainer_and_json(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    suite = write_tiny_suite(tmp_path)
    code = main(["bench", "--suite", str(suite), "--rows", "first,needs-gpu", "--results", str(results), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    stored = _rows(results)
    assert [r["name"] for r in printed["rows"]] == [r["name"] for r in stored] == ["first", "needs-gpu"]
    first, skipped = stored
    assert first["status"] == "ok", first["reason"]
    assert first["device"]["kind"] == "cpu"
    memory = first["measured"]["memory"]
    assert memory["peak_allocated"] > 0 and memory["weights"] > 0 and memory["optimizer_states"] > 0
    assert first["measured"]["samples_per_second"] > 0
    assert set(first["predicted"]["memory"]) == set(memory)
    assert first["error_pct"]["peak_allocated"] is not None
    assert skipped["status"] == "skipped" and "CUDA" in skipped["reason"]


def test_sigkill_loses_no_finished_row_and_resume_continues(tmp_path):
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
