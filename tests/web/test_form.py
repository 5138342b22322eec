"""The page's fields: generated from the Recipe dataclass, checked, and turned into the CLI's own flags."""

from __future__ import annotations

import dataclasses
import re

import pytest

from anatomist.cli import build_parser
from anatomist.cli.recipe_flags import recipe_groups
from anatomist.errors import InputError
from anatomist.recipe import Recipe, field_kinds
from anatomist.recipe.help import FIELD_HELP
from anatomist.web import service
from anatomist.web.form import QUESTION, Field, FieldError, Form, flags, parse


def _by_view(view: str) -> dict[str, Field]:
    return {f.name: f for f in service.fields() if view in f.views}


def test_every_recipe_field_is_a_field_of_the_estimate_view_with_its_choices_and_help() -> None:
    fields = _by_view("estimate")
    kinds = field_kinds()
    groups = {f.name: title for title, members in recipe_groups() for f in members}
    for f in dataclasses.fields(Recipe):
        web = fields[f.name]
        assert web.help == FIELD_HELP[f.name].text and web.group in (QUESTION, groups[f.name])  # the CLI's --help group
        assert web.flag == "--" + f.name.replace("_", "-")
        assert web.label and "_" not in web.label  # words, the name is the tooltip
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


def test_the_question_comes_first_and_the_rest_in_the_clis_groups() -> None:
    """The short form: model, GPU, method, trainer, length, batch, GPUs, nodes; every other field in a group."""
    for view, batch in (("estimate", "per_device_train_batch_size"), ("plan", "global_batch_size")):
        fields = [f for f in service.fields() if view in f.views]
        asked = [f.name for f in fields if f.group == QUESTION]
        assert asked == ["model", "config", "gpu", "peft", "trainer", "seq_len", batch, "gpus", "nodes"]
        first_other = next(i for i, f in enumerate(fields) if f.group != QUESTION)
        assert all(f.group != QUESTION for f in fields[first_other:])  # asked first, all of it
    method = next(f for f in service.fields() if f.name == "peft" and "estimate" in f.views)
    assert dict(zip(method.choices, method.choice_labels, strict=True))["none"] == "full fine-tuning"


def test_the_plan_view_offers_every_option_of_anatomist_plan() -> None:
    """Every flag of `anatomist plan` but those for a shell (--json, --emit/-o: the page's files, --calibration,
    --no-cache, --trust-remote-code, --allow-network: the server's) is a field of the plan view."""
    parser = build_parser()
    plan = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "plan")[1]
    flags_ = {s for a in plan._actions for s in a.option_strings if s.startswith("--")}
    for_a_shell = {"--help", "--json", "--emit", "--output", "--calibration", "--no-cache", "--trust-remote-code",
                   "--allow-network", "--verbose"}
    page = {f.flag for f in _by_view("plan").values() if f.flag} | {"--recipe", "--lengths"}  # the uploads
    assert flags_ - for_a_shell == page - {None}


@pytest.mark.parametrize(("params", "field", "message"), [
    ({"seq_len": "12x"}, "seq_len", "Sequence length (seq_len) must be a whole number, got '12x'"),
    ({"per_device_train_batch_size": "100000000000000000000"}, "per_device_train_batch_size",
     "Batch per GPU (per_device_train_batch_size) must be at most 2^31 - 1 = 2,147,483,647, got 100000000000000000000"),
    ({"per_device_train_batch_size": "0"}, "per_device_train_batch_size",
     "Batch per GPU (per_device_train_batch_size) must be at least 1, got 0"),
    ({"memory_margin": "1"}, "memory_margin", "Memory kept free (memory_margin) must be below 1, got 1"),
    ({"memory_margin": "nan"}, "memory_margin", "Memory kept free (memory_margin) must be a number"),
    ({"lora_dropout": "-0.1"}, "lora_dropout", "LoRA dropout (lora_dropout) must be at least 0, got -0.1"),
    ({"fp16": "yes"}, "fp16", "fp16 mixed precision (fp16) must be true or false, got 'yes'"),
    ({"optim": "adamw"}, "optim", "Optimizer (optim) must be one of adamw_torch,"),
    ({"zero_stage": "4"}, "zero_stage", "DeepSpeed ZeRO stage (zero_stage) must be one of 0, 1, 2, 3; got '4'"),
    ({"config": "../../etc"}, "config", "or upload its config.json (config) must be the id of an uploaded file"),
    ({"model": "x" * 400}, "model", "Model (model) must be at most 300 characters long, got 400"),
])
def test_bad_values_are_one_line_naming_the_field_and_its_limit(params: dict[str, str], field: str,
                                                                message: str) -> None:
    with pytest.raises(FieldError, match="^" + re.escape(message)) as caught:
        parse({"view": "estimate", **params}, service.fields())
    assert caught.value.field == field


@pytest.mark.parametrize(("params", "message"), [
    ({"global_batch_size": "8"}, "unknown field 'global_batch_size' for the estimate view"),
    ({"view": "train"}, "view must be one of estimate, plan"),
])
def test_an_unknown_field_or_view_is_one_line(params: dict[str, str], message: str) -> None:
    with pytest.raises(InputError, match="^" + message):
        parse({"view": "estimate", **params}, service.fields())


def test_an_old_link_still_parses() -> None:
    """The URL keys are the CLI's destinations, as they were: a link shared before the page was regrouped opens."""
    old = {"view": "estimate", "model": "Llama-3.2-1B", "gpu": "RTX-4090", "seq_len": "1024",
           "per_device_train_batch_size": "4", "gradient_checkpointing": "true", "bf16": "true"}
    assert flags(parse(old, service.fields()), service.fields()) == [
        "--gpu=RTX-4090", "--seq-len=1024", "--per-device-train-batch-size=4", "--gradient-checkpointing", "--bf16"]
    old_plan = {"view": "plan", "model": "gpt2", "gpu": "T4", "optims": "adamw_torch_fused", "precisions": "fp16",
                "no_compile": "true", "peft": "lora", "global_batch_size": "16"}
    assert parse(old_plan, service.fields()).values["peft"] == ("lora",)


def test_the_same_request_has_the_same_key() -> None:
    a = parse({"view": "estimate", "model": "gpt2", "seq_len": "128"}, service.fields())
    b = parse({"seq_len": "128", "model": "gpt2", "gpu": ""}, service.fields())
    assert a.key() == b.key() != Form(view="plan", values=a.values).key()


@pytest.mark.parametrize("params", [
    {"view": "estimate", "model": "gpt2", "gpu": "A100-80GB", "seq_len": "256", "per_device_train_batch_size": "16",
     "gradient_checkpointing": "true", "dataloader_pin_memory": "false", "zero_stage": "2", "optim": "adafactor",
     "lora_dropout": "0", "gpus": "2", "nodes": "2", "network": "infiniband-ndr", "memory_margin": "0.2",
     "mode": "inference", "task": "causal-lm", "avg_seq_len": "100", "prompt_len": "10"},
    {"view": "estimate", "model": "gpt2", "longest_seq_len": "true", "per_device_train_batch_size": "2"},
    {"view": "estimate"},
    {"view": "plan", "model": "gpt2", "gpu": "T4", "optims": "adamw_torch_fused", "precisions": "fp16,fp32",
     "shardings": "none,zero3", "no_compile": "true", "no_liger_kernel": "false", "peft": "lora,qlora", "lora_r": "8",
     "lora_dropout": "0", "trainer": "dpo", "precompute_ref_log_probs": "true", "padding_free": "false",
     "global_batch_size": "64", "max_nodes": "2", "objective": "memory", "memory_margin": "0.05"},
    {"view": "plan", "gpu": "T4"},
])
def test_the_page_asks_the_request_the_cli_reads_from_its_flags(params: dict[str, str]) -> None:
    """The form's request (`form.estimate_request` / `plan_request`) is the one the CLI makes of the same flags."""
    from anatomist.cli.requests import estimate_request, plan_request
    from anatomist.web import form as page

    form = parse(params, service.fields())
    model = form.get("model")
    args = build_parser().parse_args([form.view, *flags(form, service.fields()), *(["--", model] if model else [])])
    files = page.Files(model=model)
    if form.view == "estimate":
        assert page.estimate_request(form, files, allow_network=False) == estimate_request(args)
    else:
        assert page.plan_request(form, files, allow_network=False) == plan_request(args)
