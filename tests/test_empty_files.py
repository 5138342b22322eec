"""An empty file is said to be empty by every command that reads one: one line, exit 2 (a file of nothing but
blanks, or of YAML / TOML comments, is empty too)."""

from __future__ import annotations

from pathlib import Path

import pytest

GPU = ("--gpu", "A100-80GB")


@pytest.mark.parametrize(("args", "said", "commented"), [
    # JSON, JSONL and lists of numbers have no comments: a "#" line is said to be what it is instead
    (["calibrate", "{empty}"], "results file '{empty}' is empty", False),
    (["calibrate", "--records", "{empty}"], "run records '{empty}' is empty", False),
    (["report", "{empty}"], "results file {empty} is empty", False),
    (["bench", "--suite", "{empty}"], "suite file '{empty}' is empty", True),
    (["estimate", "{model}", *GPU], "model config '{model}/config.json' is empty", False),
    (["estimate", "{llama}", *GPU, "--lengths", "{empty}"], "--lengths '{empty}' is empty", False),
    (["estimate", "{llama}", *GPU, "--calibration", "{empty}"], "calibration file '{empty}' is empty", True),
    (["estimate", "{llama}", *GPU, "--recipe", "{empty}"], "recipe file '{empty}' is empty", True),
    (["plan", "{llama}", *GPU, "--recipe", "{empty}"], "recipe file '{empty}' is empty", True),
], ids=["calibrate", "calibrate-records", "report", "bench-suite", "model-config", "lengths", "calibration",
        "estimate-recipe", "plan-recipe"])
@pytest.mark.parametrize("text", ["", "\n  \n", "# a comment\n"], ids=["nothing", "blanks", "comment"])
def test_an_empty_file_is_said_to_be_empty(cli, tiny_model, tmp_path: Path, args: list[str], said: str,
                                           commented: bool, text: str) -> None:
    if text.startswith("#") and not commented:
        pytest.skip("a format without comments")
    empty, model = tmp_path / "empty.txt", tmp_path / "model"
    empty.write_text(text)
    model.mkdir()
    (model / "config.json").write_text(text)
    names = {"empty": str(empty), "model": str(model), "llama": str(tiny_model("llama"))}
    result = cli(*[a.format(**names) for a in args])
    assert result.returncode == 2, result.stdout[-300:]
    (line,) = result.stderr.strip().splitlines()
    assert line == "anatomist: error: " + said.format(**names)
