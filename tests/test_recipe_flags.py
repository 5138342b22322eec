"""The recipe flags are generated from the Recipe dataclass: every field is a flag, with its help and choices."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from anatomist.cli import build_parser
from anatomist.recipe import Recipe, field_kinds
from anatomist.recipe.help import FIELD_HELP

FIELDS = [f.name for f in dataclasses.fields(Recipe)]


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("command", ["estimate", "profile"])
def test_every_recipe_field_is_a_flag_with_the_fields_help(cli, command: str) -> None:
    result = cli(command, "--help")
    assert result.returncode == 0
    text = _squeeze(result.stdout)  # argparse wraps the help: compare without whitespace
    for field in dataclasses.fields(Recipe):
        assert re.search(rf"--{field.name.replace('_', '-')}\b", result.stdout), field.name
        assert _squeeze(FIELD_HELP[field.name].text) in text, field.name


@pytest.mark.slow
def test_fsdp_has_a_flag_that_reaches_the_estimate(cli, tiny_model) -> None:
    result = cli("estimate", str(tiny_model("bert")), "--fsdp", "shard_grad_op", "--gpus", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["recipe"]["fsdp"] == "shard_grad_op"


SAMPLES = {int: "3", float: "0.25", str: "q_proj,v_proj"}


@pytest.mark.parametrize("name", FIELDS)
def test_flags_read_values_as_hf_argument_parser_reads_the_same_dataclass(name: str) -> None:
    """transformers' HfArgumentParser, given Recipe, parses each value to what our generated flag does."""
    from transformers import HfArgumentParser

    kind = field_kinds()[name]
    if kind.type is bool:
        values = [("", True)]
    elif kind.choices is not None:
        values = [(str(c), c) for c in kind.choices]
    else:
        values = [(SAMPLES[kind.type], kind.type(SAMPLES[kind.type]))]
    theirs = HfArgumentParser(Recipe)
    required = ["--optim", "sgd", "--fsdp", "none"]  # fields whose default is a factory: HfArgumentParser needs them
    for text, expected in values:
        ours = build_parser().parse_args(["estimate", f"--{name.replace('_', '-')}", *([text] if text else [])])
        assert getattr(ours, name) == expected
        # HfArgumentParser takes an optional boolean (default None) with its value only: `--fp8_all_gather true`.
        theirs_text = text or ("true" if kind.type is bool and kind.optional else "")
        parsed = theirs.parse_args([*required, f"--{name}", *([theirs_text] if theirs_text else [])])  # unvalidated
        assert getattr(parsed, name) == expected


def test_a_flag_not_given_is_none_so_it_overrides_nothing() -> None:
    args = build_parser().parse_args(["estimate"])
    assert all(getattr(args, name) is None for name in FIELDS)
