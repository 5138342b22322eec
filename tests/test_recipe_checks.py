"""The recipe's checks are the library's and the CLI's alike; its help texts are outside the trace code digest;
the axes are data that reads no recipe."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import anatomist
from anatomist.errors import InputError
from anatomist.estimate.predict import estimate
from anatomist.hardware import get_gpu
from anatomist.recipe import Recipe
from anatomist.recipe.checks import check_gpu, emulated_bf16_note
from anatomist.recipe.help import FIELD_HELP
from anatomist.trace.store.keys import TRACE_SOURCES
from anatomist.workload_loader import load_workload

V100, T4 = get_gpu("V100-16GB"), get_gpu("T4")


@pytest.mark.parametrize(("flags", "gpu", "message"), [
    (["--bf16"], V100, "bf16 needs an Ampere or newer GPU; V100-16GB has none (use --fp16)"),
    (["--tf32"], V100, "tf32 needs an Ampere or newer GPU; V100-16GB has none"),
    (["--dtype", "float16", "--cut-cross-entropy"], T4, "Cut Cross-Entropy needs an Ampere or newer GPU; T4 is older"),
])
def test_the_library_refuses_what_the_gpu_cannot_run_as_the_cli_does(cli, flags: list[str], gpu, message: str) -> None:
    given = {"--bf16": {"bf16": True}, "--tf32": {"tf32": True}}.get(flags[0], {"dtype": "float16"})
    recipe = Recipe(**given, cut_cross_entropy="--cut-cross-entropy" in flags)
    with pytest.raises(InputError) as refused:
        estimate(load_workload("gpt2", seq_len=128), recipe, gpu)
    assert str(refused.value) == message
    result = cli("estimate", "gpt2", "--seq-len", "128", "--gpu", gpu.name, *flags)
    assert (result.returncode, result.stderr) == (2, f"anatomist: error: {message}\n")


def test_a_bfloat16_dtype_given_on_the_command_line_is_refused_before_cut_cross_entropy(cli) -> None:
    """The CLI says what to load instead; the library predicts bfloat16 weights as they would run (emulated)."""
    result = cli("estimate", "gpt2", "--seq-len", "128", "--gpu", "V100-16GB", "--dtype", "bfloat16",
                 "--cut-cross-entropy")
    assert result.stderr == ("anatomist: error: --dtype bfloat16 needs an Ampere or newer GPU; V100-16GB has none "
                             "(use --dtype float16 or float32)\n")


def test_a_checkpoints_own_bfloat16_is_said_on_an_older_gpu_not_refused() -> None:
    resolved = Recipe(dtype="bfloat16").replace(attn_implementation="sdpa")  # as if "auto" had resolved so
    check_gpu(resolved, V100, dtype_given=False)
    assert emulated_bf16_note(resolved, V100, "m") == (
        "m loads in bfloat16 (its config's dtype) but V100-16GB has no bf16 tensor cores: it runs emulated and "
        "slowly there; --dtype float16 or float32 is the usual choice")
    with pytest.raises(InputError, match="--dtype bfloat16 needs an Ampere"):
        check_gpu(resolved, V100)


@pytest.mark.parametrize("given", [
    {}, {"gradient_checkpointing": True}, {"checkpoint_every": 2}, {"checkpoint_offload": True},
    {"gradient_checkpointing": True, "activation_offloading": True}, {"activation_offloading": True},
])
def test_checkpointing_every_layer_is_what_the_tables_call_on(given: dict[str, object]) -> None:
    recipe = Recipe.with_presets(**given)
    assert recipe.checkpoints_every_layer == (recipe.checkpointing == "on")


def test_every_field_has_its_help_and_every_help_its_field() -> None:
    assert list(FIELD_HELP) == [f.name for f in dataclasses.fields(Recipe)]


def test_help_texts_are_outside_the_trace_code_digest() -> None:
    """An edited help text keeps the cached traces: the digest does not read it, and the recipe does not load it."""
    assert "recipe/help.py" not in TRACE_SOURCES
    code = "import sys, anatomist.recipe; print('anatomist.recipe.help' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_axes_are_data_that_read_no_recipe_and_build_nothing() -> None:
    """axes/ imports neither the recipe nor the tracer, not even for a type."""
    for path in (Path(anatomist.__file__).parent / "axes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("anatomist.recipe", "anatomist.trace")), (path.name, node.module)
