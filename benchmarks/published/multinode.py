"""Check the multi-device time model on llm-foundry's published runs on 16 to 512 GPUs, never fitted.

    PYTHONPATH=src python benchmarks/published/multinode.py extract README.md   # write multinode.toml
    PYTHONPATH=src python benchmarks/published/multinode.py check               # predict every row, print the table

The time calibration is fitted on single-node rows (runs.toml, fit.py), where communication was assumed
hidden. llm-foundry's benchmark README (the commit in runs.toml's llm-foundry sources) also publishes the
same MPT models on 2 to 64 nodes of 8 GPUs; runs.toml leaves them out. `extract` copies those rows, each
with the exact line it was read from, into multinode.toml; `check` predicts each with the product's
`predict_time` (the published calibration, FSDP as the row says, the row's node count and network) and
prints the predicted tokens/s per GPU against the measured, once as predicted (collectives overlapping the
compute) and once with every collective added to the step (no overlap), which is what the time model
assumed before.

Networks: the A100 tables say "1600 Gbps node-node interconnect (RoCE)" (`roce-1600`); the H100 tables say
nothing, so they get the catalog's default (`infiniband-ndr`, a 400 Gb/s NIC per GPU): an assumption.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROWS = HERE / "multinode.toml"
GPUS = {"h100_80gb": ("H100-SXM", "infiniband-ndr"), "a100_80gb": ("A100-80GB", "roce-1600"),
        "a100_40gb": ("A100-40GB", "roce-1600")}
PRECISIONS = {("amp_bf16", "DEFAULT"): "bf16", ("bf16", "PURE"): "bf16-weights"}
SHARDINGS = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op"}
GPUS_PER_NODE = 8


def extract(readme: Path) -> str:
    """multinode.toml's text: every bf16 row of the README's tables on more than one node."""
    lines = ["# llm-foundry's MPT benchmark rows on more than one node of 8 GPUs (benchmarks/published/multinode.py",
             "# extract): never fitted, checked by `multinode.py check`. Source: runs.toml's llm-foundry sources.", ""]
    section = ""
    for line in readme.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 20 or not cells[2].isdigit() or int(cells[2]) <= GPUS_PER_NODE:
            continue
        model, seq, gpus, gpu, *_ = cells
        if gpu not in GPUS or (cells[14], cells[15]) not in PRECISIONS:
            continue
        lines += ["[[runs]]", f'section = "{section}"', f'model = "mpt-{model}"', f"seq_len = {seq}",
                  f"num_gpus = {gpus}", f'gpu = "{gpu}"', f"per_device_train_batch_size = {cells[7]}",
                  f"gradient_accumulation_steps = {cells[8]}", f'precision = "{PRECISIONS[cells[14], cells[15]]}"',
                  f'sharding = "{SHARDINGS[cells[16]]}"', f"gradient_checkpointing = {cells[17].lower()}",
                  f"tokens_per_second_per_gpu = {cells[12]}", f'quote = "{line.strip()}"', ""]
    return "\n".join(lines)


def predict(run: dict[str, Any]) -> tuple[float, float]:
    """Predicted tokens/s per GPU of `run`: as the time model says, and with no collective hidden."""
    sys.path.insert(0, str(HERE))
    import fit

    from anatomist.estimate.time.cluster import predict_time
    from anatomist.hardware import get_gpu

    gpu, network = GPUS[run["gpu"]]
    spec = {**run, "task": "causal-lm", "optim": "adamw_torch", "attn_implementation": "sdpa"}
    with tempfile.TemporaryDirectory() as tmp:
        workload = fit._workload(spec, Path(tmp))
        recipe = fit._recipe(spec).replace(fsdp=run["sharding"]).resolved(workload)
        time = predict_time(workload, recipe, get_gpu(gpu), num_gpus=run["num_gpus"],
                            nodes=run["num_gpus"] // GPUS_PER_NODE, network=network)
    per_gpu = time.tokens_per_second / run["num_gpus"]
    return per_gpu, per_gpu * time.step_s / (time.step_s + time.hidden_communication_s)


def check() -> None:
    runs = tomllib.loads(ROWS.read_text())["runs"]
    print("| model | seq | GPUs | GPU | micro-batch x accumulation | measured T/s/GPU | predicted | error | "
          "no overlap | error |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    errors: dict[str, list[float]] = {"overlap": [], "none": []}
    for n, run in enumerate(runs):
        overlapped, serial = predict(run)
        measured = run["tokens_per_second_per_gpu"]
        errors["overlap"].append(overlapped / measured - 1)
        errors["none"].append(serial / measured - 1)
        print(f"| {run['model']} | {run['seq_len']} | {run['num_gpus']} | {run['gpu']} | "
              f"{run['per_device_train_batch_size']} x {run['gradient_accumulation_steps']} | {measured:,} | "
              f"{overlapped:,.0f} | {errors['overlap'][-1]:+.1%} | {serial:,.0f} | {errors['none'][-1]:+.1%} |",
              flush=True)
        print(f"[{n + 1}/{len(runs)}]", file=sys.stderr, flush=True)
    for name, e in errors.items():
        absolute = [abs(x) for x in e]
        print(f"\n{name}: median |error| {statistics.median(absolute):.1%}, worst {max(absolute):.1%}, "
              f"median signed {statistics.median(e):+.1%} ({len(e)} rows)")


if __name__ == "__main__":
    if sys.argv[1] == "extract":
        ROWS.write_text(extract(Path(sys.argv[2])))
    else:
        check()
