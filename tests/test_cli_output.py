"""How the CLI's tables read where they are read: an 80-column terminal, a pipe, a reader that goes away."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anatomist.cli import catalog, render
from anatomist.model_catalog import catalog_aliases, catalog_entries


def test_models_piped_lists_every_name_whole(cli) -> None:
    result = cli("models")  # captured: not a terminal; the aliases follow after a blank line
    models, aliases = (block.splitlines() for block in result.stdout.split("\n\n"))
    assert models[0].split() == ["name", "Hub", "id", "family", "parameters", "layers", "context", "MoE"]
    assert [line.split()[0] for line in models[1:]] == list(catalog_entries())
    assert [line.split()[0] for line in aliases[1:]] == list(catalog_aliases())
    assert "…" not in result.stdout and "┃" not in result.stdout


def test_models_in_an_80_column_terminal_keeps_every_name_whole(monkeypatch) -> None:
    screen = io.StringIO()

    def terminal(stderr: bool = False) -> render.Console:
        return render._Console(file=screen, force_terminal=True, width=80, color_system=None)

    monkeypatch.setattr(catalog, "console", terminal)
    catalog.run_models(type("Args", (), {"json": False})())
    lines = screen.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    for name in catalog_entries():
        assert any(f" {name} " in line for line in lines), name
    for hub_id in catalog_aliases():  # the alias table is drawn without edge padding to hold the longest
        assert any(f"│{hub_id} " in line for line in lines), hub_id


def test_a_reader_that_goes_away_is_not_an_error() -> None:
    """`anatomist models | head -0`: the pipe is closed before anything is written."""
    proc = subprocess.Popen([sys.executable, "-m", "anatomist", "models"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b""


def test_a_command_leaves_the_process_as_it_found_it(cli, monkeypatch) -> None:
    import gc
    import os

    from anatomist.cli import command_settings

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    thresholds = gc.get_threshold()
    assert cli("gpus").returncode == 0
    assert "HF_HUB_OFFLINE" not in os.environ and gc.get_threshold() == thresholds
    with command_settings():
        assert os.environ["HF_HUB_OFFLINE"] == "1"  # offline unless asked
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with command_settings(allow_network=True):
        assert "HF_HUB_OFFLINE" not in os.environ  # --allow-network lets huggingface_hub ask the Hub
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_json_is_all_that_reaches_stdout(monkeypatch, capsys) -> None:
    """What a library prints on stdout while a --json command runs goes to stderr: DeepSpeed's logger printed its
    "Setting accelerator to CPU" before the JSON of `profile --peft qlora --json` (bitsandbytes' loading imports
    accelerate, which imports DeepSpeed)."""
    import json

    from anatomist.cli import main

    real = catalog.run_models

    def noisy(args) -> int:  # type: ignore[no-untyped-def]
        print("[WARNING] [real_accelerator.py] a library's line on stdout")
        return real(args)

    monkeypatch.setattr(catalog, "run_models", noisy)
    assert main(["models", "--json"]) == 0
    captured = capsys.readouterr()
    assert [m["name"] for m in json.loads(captured.out)["models"]] == list(catalog_entries())
    assert "a library's line on stdout" in captured.err


# ---- every command through a pipe ---------------------------------------------------------------------------------

BOX = set("┃│━─┏┓┗┛┡┩└┘├┤┼╇")
FIXTURES = Path(__file__).parent / "fixtures"


def _piped(command: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """`anatomist COMMAND | cat` in a shell, as a CI log or a redirect reads it (stderr kept apart)."""
    return subprocess.run(["sh", "-c", f"{sys.executable} -m anatomist {command} | cat"], capture_output=True,
                          text=True, timeout=600, cwd=folder, env={**os.environ, "COLUMNS": "80"})


def _whole(out: str) -> None:
    """Nothing cut, no box drawn: what a pipe must get."""
    assert "…" not in out and not BOX & set(out), out


def _config(folder: Path, name: str) -> Path:
    from tests.conftest import write_config

    return write_config(folder, name)


@pytest.mark.slow  # ten fresh interpreters, one cold plan of a tiny model: ~1 min on 2 idle cores
def test_every_command_piped_through_cat_keeps_every_name_and_line_whole(tmp_path: Path) -> None:
    from anatomist.hardware import catalog as gpu_catalog

    gpus = _piped("gpus", tmp_path)
    _whole(gpus.stdout)
    names = [line.split()[0] for line in gpus.stdout.splitlines()[2:] if line and not line.startswith(("TFLOP", "*"))]
    assert names == list(gpu_catalog())  # A100-PCIe-40GB, not A100-PCI…

    llama = _config(tmp_path, "llama")
    estimate = _piped(f"estimate {llama} --gpu A100-80GB --seq-len 64 --use-liger-kernel", tmp_path)
    assert estimate.returncode == 0, estimate.stderr
    _whole(estimate.stdout)
    lines = estimate.stdout.splitlines()
    assert lines[0].endswith("train on 1 x A100-80GB (80.00 GiB)") and len(lines[0]) > 80  # one line, not wrapped at 80
    verdict = next(line for line in lines if line.startswith("peak in "))
    assert "margin): fits; largest batch that fits: " in verdict
    assert any(line.startswith("bytes/param rule: ") and 'guide "Model training anatomy")' in line for line in lines)

    small = _piped(f"estimate {llama} --gpu A100-80GB --seq-len 64 --memory-margin 0.9999", tmp_path)
    assert "largest batch that fits: none: even batch 1 does not fit" in small.stdout, small.stderr
    assert "no change of batch, accumulation, checkpointing or optimizer fits; LoRA or QLoRA" in small.stdout
    assert f"`anatomist plan {llama} --gpu A100-80GB --seq-len 64 --peft lora,qlora` searches the first" in small.stdout

    plan = _piped(f"plan {llama} --gpu A100-80GB --seq-len 64 --global-batch-size 8 --optims adamw_torch_fused "
                  "--precisions bf16 --no-compile", tmp_path)
    assert plan.returncode == 0, plan.stderr
    _whole(plan.stdout)
    top = next(line for line in plan.stdout.splitlines() if line.startswith("top pick: "))
    assert top.endswith("samples/s predicted") and "Liger Kernel " in top  # the pick line says Liger either way
    table = plan.stdout.split("Pareto front (throughput vs peak device memory)\n")[1].splitlines()
    assert table[0].split()[:3] == ["batch", "x", "accum"]
    assert any(line.startswith("every recipe above: ") for line in table)

    check = _piped(f"check {llama} --gpu A100-80GB --seq-len 64", tmp_path)
    assert check.returncode == 0 and "anatomist pre-flight" in check.stdout, check.stderr
    _whole(check.stdout)

    for command in ("models", "env", f"report {FIXTURES / 'plan_schema_example.json'} -o {tmp_path / 'r.html'}"):
        piped = _piped(command, tmp_path)
        assert piped.returncode == 0, piped.stderr
        _whole(piped.stdout)
    assert set(catalog_entries()) <= {line.split()[0] for line in _piped("models", tmp_path).stdout.splitlines() if line.split()}

    profile = _piped(f"profile {_config(tmp_path, 'bert')} --seq-len 16 --steps 1", tmp_path)
    assert profile.returncode == 0, profile.stderr
    _whole(profile.stdout)
    assert "aten::" in profile.stdout
    # transformers' FutureWarning and the profiler's own lines stay off the screen (--verbose shows them)
    assert "Warning" not in profile.stderr and "USDT:" not in profile.stderr and "profiler_start" not in profile.stderr


@pytest.mark.slow  # one real training run in a subprocess
def test_bench_writes_its_table_to_stdout_and_its_progress_to_stderr(tmp_path: Path) -> None:
    from tests.bench_tiny import write_tiny_suite

    suite = write_tiny_suite(tmp_path)
    bench = _piped(f"bench --suite {suite} --rows first,needs-gpu --results {tmp_path / 'r.jsonl'}", tmp_path)
    assert bench.returncode == 0, bench.stderr
    _whole(bench.stdout)
    rows = {line.split()[0]: line for line in bench.stdout.splitlines()[2:]}
    assert rows["first"].split()[1] == "ok"
    assert "needs-gpu" in rows and rows["needs-gpu"].split()[1] == "skipped"
    skipped = next(json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()[1:]
                   if json.loads(line)["name"] == "needs-gpu")
    assert rows["needs-gpu"].endswith(skipped["reason"])  # the reason whole
    assert "bench: 1/2 first: ok" in bench.stderr and "bench: 2/2 needs-gpu: skipped" in bench.stderr


def test_the_cluster_table_names_each_pick_by_what_differs(capsys) -> None:
    """--max-nodes' table: each size's pick by the settings in which the picks differ, what they share said once."""
    from types import SimpleNamespace

    from anatomist.cli import plan as plan_cli
    from anatomist.recipe import Recipe

    def size(gpus: int, nodes: int, recipe: Recipe | None, chosen: object = None) -> SimpleNamespace:
        best = None if recipe is None else SimpleNamespace(recipe=recipe, samples_per_second=2.0 * gpus,
                                                           device_total=30 * 2**30)
        return SimpleNamespace(num_gpus=gpus, nodes=nodes, best=best, plan=chosen, samples_per_gpu=2.0,
                               why_not=None if recipe else "no sharding of --shardings runs on 1 GPU")

    chosen = object()
    base = Recipe(per_device_train_batch_size=2, bf16=True, use_liger_kernel=True)
    clusters = [size(1, 1, None), size(2, 1, Recipe(**{**base.to_dict(), "zero_stage": 3}), chosen),
                size(4, 1, Recipe(**{**base.to_dict(), "fsdp": "full_shard"}))]
    plan_cli.render_clusters(clusters, chosen)  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["GPUs", "nodes", "samples/s", "per", "GPU", "device", "memory", "pick"]
    assert lines[2].split()[:2] == ["1", "1"] and lines[2].endswith("no sharding of --shardings runs on 1 GPU")
    assert lines[3].startswith("*") and lines[3].endswith("sharding zero3")  # the chosen size, marked
    assert lines[4].endswith("sharding fsdp_full_shard")
    assert lines[5].startswith("every pick: full fine-tuning, checkpointing off, bf16, ") and "Liger Kernel on" in lines[5]
