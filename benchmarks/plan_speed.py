"""How fast `anatomist plan` searches: candidates per second for bert-large-uncased.

Each GPU is planned in a fresh process (no trace cache carried over), global batch 64,
default search space. Prints wall and CPU seconds; the bar is >= 200 candidates in <= 30 s.

    PYTHONPATH=src python benchmarks/plan_speed.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

CHILD = """
import json, os, time
t0, c0 = time.perf_counter(), time.process_time()
from anatomist.hardware import get_gpu
from anatomist.plan import SearchSpace, plan
from anatomist.workload import load_workload
result = plan(load_workload("bert-large-uncased"), get_gpu(os.environ["GPU"]), space=SearchSpace(global_batch_size=64))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"gpu": os.environ["GPU"], "candidates": len(result.candidates), "feasible": len(result.feasible),
                  "wall_s": wall, "cpu_s": cpu, "candidates_per_s": len(result.candidates) / wall}))
"""


def main() -> int:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    for gpu in ("V100-16GB", "A100-80GB"):
        proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                              env={**os.environ, "GPU": gpu, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{r['gpu']:>10}: {r['candidates']} candidates ({r['feasible']} fit) in {r['wall_s']:.1f} s wall, "
              f"{r['cpu_s']:.1f} s CPU: {r['candidates_per_s']:.1f} candidates/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
