"""How the CLI's tables read where they are read: an 80-column terminal, a pipe, a reader that goes away."""

from __future__ import annotations

import io
import subprocess
import sys

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
