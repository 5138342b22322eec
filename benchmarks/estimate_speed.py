"""How fast is anatomist, as a ratio to importing torch + transformers in the same run?

Machines differ (the import alone takes 4 s on one, 7 s on another), so every figure is a
ratio to that import floor, measured here with the same interpreter, each case a fresh
process, median of `--repeats` runs:

  floor          python -c "import torch, transformers, transformers.models.bert.modeling_bert"
  estimate cold  anatomist estimate bert-large-uncased (empty trace cache)
  estimate warm  the same, trace cache filled: a cache hit, which imports neither torch nor transformers
  plan cold/warm anatomist plan bert-large-uncased --gpu V100-16GB --global-batch-size 32
  sizes cold     anatomist plan Llama-3.1-8B --gpus 8 --max-nodes 2 ... (docs/plan.md's command: 1, 2, 4, 8
                 and 16 GPUs, every sharding each allows, FSDP traced at each world size)
  sizes no-FSDP  the same plan with --shardings none,zero2+offload,zero2,zero3: what the cluster sizes cost without
                 FSDP's traces (one device's traces and the arithmetic of ZeRO)
  sharded cold   anatomist estimate bert-large-uncased --fsdp full_shard --gpus 8 (one rank of 8, traced
                 under FSDP2), against "estimate cold" of the same model on one device
  longest cold   anatomist estimate Llama-3.2-1B --gpu RTX-4090 --bf16 --batch-size 1 --longest-seq-len (the
                 longest sequence that fits, searched over 1,024 lengths: three traced, the others derived)
  length warm    the same recipe at 50,000 tokens after it, a length never traced: derived from the cache's three
                 lengths, without importing torch or transformers (issue 46: <= 0.1x)
  --help, gpus, models  (none imports torch or transformers)

    .venv/bin/python benchmarks/estimate_speed.py [--repeats 3] [--cases "plan cold" "sizes cold" ...]

The bars (DESIGN.md, issue 21): estimate <= 1.0x cold, <= 0.3x on a trace-cache hit; a plan over >= 200
distinct recipes <= 2.0x cold, <= 1.0x warm; the plan over cluster sizes <= 3.0x cold; the sharded
estimate <= 2.0x the single-device one; --help/gpus/models under 1 s.
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
SIZES_PLAN = ["-m", "anatomist", "plan", "Llama-3.1-8B", "--gpu", "H100-80GB", "--gpus", "8", "--max-nodes", "2",
              "--global-batch-size", "64", "--seq-len", "2048", "--optims", "adamw_torch_fused", "--precisions", "bf16",
              "--no-compile", "--no-liger-kernel", "--json"]
SIZES_WITHOUT_FSDP = [*SIZES_PLAN, "--shardings", "none,zero2+offload,zero2,zero3"]
SHARDED_ESTIMATE = [*ESTIMATE, "--fsdp", "full_shard", "--gpus", "8"]
LONGEST = ["-m", "anatomist", "estimate", "Llama-3.2-1B", "--gpu", "RTX-4090", "--bf16", "--batch-size", "1", "--json"]
CASES: dict[str, tuple[list[str], bool]] = {
    "estimate cold": (ESTIMATE, True),
    "estimate warm": (ESTIMATE, False),
    "plan cold": (PLAN, True),
    "plan warm": (PLAN, False),
    "sizes cold": (SIZES_PLAN, True),
    "sizes no-FSDP": (SIZES_WITHOUT_FSDP, True),
    "sharded cold": (SHARDED_ESTIMATE, True),
    "longest cold": ([*LONGEST, "--longest-seq-len"], True),
    "length warm": ([*LONGEST, "--seq-len", "50000"], False),
    "--help": (["-m", "anatomist", "--help"], False),
    "gpus": (["-m", "anatomist", "gpus"], False),
    "models": (["-m", "anatomist", "models"], False),
}
"""Each case: its arguments, and whether it starts from an empty trace cache (cold) or from the one the
case before it left (a warm case follows its cold one)."""
UNTIMED_RATIOS = ("floor", "--help", "gpus", "models")


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
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="the cases to time (default: all); the floor is always timed")
    args = parser.parse_args()
    repeats = args.repeats
    cache = tempfile.mkdtemp(prefix="anatomist-speed-")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "ANATOMIST_CACHE_DIR": cache,
           "OMP_WAIT_POLICY": "PASSIVE"}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    results: dict[str, float] = {}

    def median_of(name: str, args: list[str], cold: bool) -> str:
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
    outputs = {name: median_of(name, *CASES[name]) for name in CASES if name in args.cases}
    floor = results["floor"]
    if "plan cold" in outputs:
        plan = json.loads(outputs["plan cold"])
        print(f"plan: {plan['candidates']} candidates, {plan['feasible']} fit")
    if "sizes cold" in outputs:
        sizes = json.loads(outputs["sizes cold"])
        print(f"sizes: {len(sizes['clusters'])} cluster sizes, the chosen one {sizes['num_gpus']} GPU(s)")
    print("ratios to the import floor: " + ", ".join(
        f"{name} {value / floor:.2f}x" for name, value in results.items() if name not in UNTIMED_RATIOS))
    if "sizes cold" in results and "sizes no-FSDP" in results:
        print(f"sizes cold / sizes no-FSDP: {results['sizes cold'] / results['sizes no-FSDP']:.2f}x")
    if "sharded cold" in results and "estimate cold" in results:
        print(f"sharded cold / estimate cold: {results['sharded cold'] / results['estimate cold']:.2f}x")
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
