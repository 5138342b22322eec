"""How fast is anatomist, as a ratio to importing torch + transformers in the same run?

Machines differ (the import alone takes 4 s on one, 7 s on another), so every figure is a
ratio to that import floor, measured here with the same interpreter, each case a fresh
process, median of `--repeats` runs:

  floor          python -c "import torch, transformers, transformers.models.bert.modeling_bert"
  estimate cold  anatomist estimate bert-large-uncased (empty trace cache)
  estimate warm  the same, trace cache filled: a cache hit, which imports neither torch nor transformers
  plan cold/warm anatomist plan bert-large-uncased --gpu V100-16GB --global-batch-size 32
  --help, gpus, models  (none imports torch or transformers)

    .venv/bin/python benchmarks/estimate_speed.py [--repeats 3]

The bars (DESIGN.md): estimate <= 1.0x cold, <= 0.3x on a trace-cache hit; a plan over >= 200
distinct recipes <= 2.0x cold, <= 1.0x warm; --help/gpus/models under 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

FLOOR = ["-c", "import torch, transformers, transformers.models.bert.modeling_bert"]
ESTIMATE = ["-m", "anatomist", "estimate", "bert-large-uncased", "--json"]
PLAN = ["-m", "anatomist", "plan", "bert-large-uncased", "--gpu", "V100-16GB", "--global-batch-size", "32", "--json"]


def timed(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {proc.stderr.strip()[-500:]}")
    return elapsed, proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    cache = tempfile.mkdtemp(prefix="anatomist-speed-")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "ANATOMIST_CACHE_DIR": cache,
           "OMP_WAIT_POLICY": "PASSIVE"}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    results: dict[str, float] = {}

    def median_of(name: str, args: list[str], *, cold: bool) -> str:
        times, out = [], ""
        for _ in range(repeats):
            if cold:
                shutil.rmtree(cache, ignore_errors=True)
            elapsed, out = timed(args, env)
            times.append(elapsed)
        results[name] = statistics.median(times)
        print(f"  {name:<14} " + ", ".join(f"{t:.2f}" for t in times) + f" s; median {results[name]:.2f} s")
        return out

    median_of("floor", FLOOR, cold=False)
    median_of("estimate cold", ESTIMATE, cold=True)
    median_of("estimate warm", ESTIMATE, cold=False)
    plan_out = median_of("plan cold", PLAN, cold=True)
    median_of("plan warm", PLAN, cold=False)
    median_of("--help", ["-m", "anatomist", "--help"], cold=False)
    median_of("gpus", ["-m", "anatomist", "gpus"], cold=False)
    median_of("models", ["-m", "anatomist", "models"], cold=False)
    plan = json.loads(plan_out)
    floor = results["floor"]
    print(f"plan: {plan['candidates']} candidates, {plan['feasible']} fit")
    print("ratios to the import floor: " + ", ".join(
        f"{name} {value / floor:.2f}x" for name, value in results.items() if name not in ("floor", "--help", "gpus", "models")))
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
