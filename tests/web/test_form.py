"""The page's fields: generated from the Recipe dataclass, checked, and turned into the CLI's own flags."""

from __future__ import annotations

import dataclasses

import pytest

from anatomist.cli import build_parser
from anatomist.errors import InputError
from anatomist.recipe import Recipe, field_kinds
from anatomist.web import service
from anatomist.web.form import Field, Form, flags, parse


def _by_view(view: str) -> dict[str, Field]:
    return {f.name: f for f in service.fields() if view in f.views}


def test_every_recipe_field_is_a_field_of_the_estimate_view_with_its_choices_and_help() -> None:
    fields = _by_view("estimate")
    kinds = field_kinds()
    for f in dataclasses.fields(Recipe):
        web = fields[f.name]
        assert web.help == f.metadata["help"] and web.section == "recipe"
        assert web.flag == "--" + f.name.replace("_", "-")
        if kinds[f.name].type is bool:
            assert web.kind == "bool"
        elif kinds[f.name].choices is not None:
            assert web.kind == "choice" and web.choices == kinds[f.name].choices
        else:
            assert web.kind == kinds[f.name].type.__name__
    assert fields["zero_stage"].choices == (0, 1, 2, 3)  # Literal[0, 1, 2, 3]: ints, not strings
    assert fields["per_device_train_batch_size"].default == Recipe().per_device_train_batch_size


def test_a_form_becomes_the_flags_the_cli_parser_reads_back() -> None:
    form = parse({"view": "estimate", "model": "gpt2", "gpu": "A100-80GB", "seq_len": "256",
                  "per_device_train_batch_size": "16", "gradient_checkpointing": "true", "dataloader_pin_memory": "false",
                  "zero_stage": "2", "optim": "adafactor", "lora_target_modules": "-q_proj", "task": ""}, service.fields())
    assert form.values["zero_stage"] == 2 and form.values["per_device_train_batch_size"] == 16
    assert "task" not in form.values  # empty: unset, the CLI's default applies
    argv = flags(form, service.fields())
    assert "--gradient-checkpointing" in argv and "--no-dataloader-pin-memory" in argv
    args = build_parser().parse_args(["estimate", *argv, "--", "gpt2"])
    assert (args.seq_len, args.per_device_train_batch_size, args.zero_stage, args.optim) == (256, 16, 2, "adafactor")
    assert args.gradient_checkpointing is True and args.dataloader_pin_memory is False
    assert args.lora_target_modules == "-q_proj"  # --flag=value: a value starting with '-' stays a value
    assert args.fp16 is None  # not given: the recipe's default, not False


def test_the_plan_view_has_its_search_options() -> None:
    form = parse({"view": "plan", "model": "gpt2", "gpu": "T4", "optims": "adamw_torch_fused", "precisions": "fp16,fp32",
                  "shardings": "none,zero3", "no_compile": "true", "peft": "lora"}, service.fields())
    args = build_parser().parse_args(["plan", *flags(form, service.fields()), "--", "gpt2"])
    assert (args.optims, args.precisions, args.shardings, args.no_compile, args.peft) == \
        ("adamw_torch_fused", "fp16,fp32", "none,zero3", True, "lora")


@pytest.mark.parametrize(("params", "message"), [
    ({"seq_len": "12x"}, "seq_len must be a whole number, got '12x'"),
    ({"memory_margin": "nan"}, "memory_margin must be a number"),
    ({"fp16": "yes"}, "fp16 must be true or false, got 'yes'"),
    ({"optim": "adamw"}, "optim: unknown value 'adamw'; known: adamw_torch,"),
    ({"zero_stage": "4"}, "zero_stage: unknown value '4'"),
    ({"global_batch_size": "8"}, "unknown field 'global_batch_size' for the estimate view"),
    ({"config": "../../etc"}, "config: not an upload id"),
    ({"model": "x" * 400}, "model: at most 300 characters"),
    ({"view": "train"}, "view must be one of estimate, plan"),
])
def test_bad_values_are_one_line_naming_the_field(params: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        parse({"view": "estimate", **params}, service.fields())


def test_the_same_request_has_the_same_key() -> None:
    a = parse({"view": "estimate", "model": "gpt2", "seq_len": "128"}, service.fields())
    b = parse({"seq_len": "128", "model": "gpt2", "gpu": ""}, service.fields())
    assert a.key() == b.key() != Form(view="plan", values=a.values).key()
