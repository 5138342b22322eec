"""Bad input: one line on stderr, exit code 2, no traceback (in-process; the process itself: test_process.py)."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate", "bert-lage-uncased"], "unknown model 'bert-lage-uncased'.*did you mean bert-large-uncased"),
        (["estimate", "--fp16", "--bf16"], "fp16 and bf16 are mutually exclusive"),
        (["estimate", "--bf16", "--gpu", "V100-16GB"], "bf16 needs an Ampere or newer GPU"),
        (["estimate", "--batch-size", "0"], "per_device_train_batch_size must be greater than 0, got 0"),
        # choices come from the Recipe field's Literal; argparse refuses others before anything is imported
        (["estimate", "--optim", "adam9000"], r"argument --optim: invalid choice: 'adam9000' \(choose from 'adamw_torch'"),
        (["estimate", "--seq-len", "4096"], "seq_len 4096 is above bert-large-uncased's maximum of 512"),
        (["estimate", "--gpu", "a1000"], "unknown GPU 'a1000'"),
        (["estimate", "--dtype", "int4"],
         r"argument --dtype: invalid choice: 'int4' \(choose from 'auto', 'float32', 'bfloat16', 'float16'\)"),
        (["estimate", "--fsdp", "hybrid_shard"], r"argument --fsdp: invalid choice: 'hybrid_shard'"),
        (["estimate", "--zero-stage", "4"], r"argument --zero-stage: invalid choice: 4 \(choose from 0, 1, 2, 3\)"),
        (["estimate", "--fsdp", "full_shard", "--zero-stage", "2"], "fsdp and DeepSpeed ZeRO .zero_stage. are exclusive"),
        (["estimate", "--fsdp", "full_shard", "--gpus", "2", "--optim", "adafactor"], "optim=adafactor does not run under FSDP2"),
        (["estimate", "--dtype", "float16", "--fp16"], "PyTorch refuses to unscale fp16 gradients"),
        (["estimate", "--dtype", "bfloat16", "--gpu", "T4"], "--dtype bfloat16 needs an Ampere or newer GPU"),
        (["estimate", "--offload", "cpu"], "offload=cpu needs DeepSpeed ZeRO"),
        (["estimate", "--recipe", "/nonexistent.yaml"], "recipe file '/nonexistent.yaml' does not exist"),
        (["estimate", "--recipe", "/"], "recipe file '/' is a folder, not a file"),
        (["estimate", "--batch-size", "four"], "--batch-size: must be a whole number, got 'four'"),
        (["estimate", "--batch-size", "100000000000000000000"],
         r"--batch-size: must be at most 2\^31 - 1 = 2,147,483,647, got 100000000000000000000"),
        (["plan", "gpt2", "--gpu", "T4", "--global-batch-size", "1e20"], "--global-batch-size: must be a whole number"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, args, message):
    result = cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"model_type": "bert", "hidden_size": -3}', "field hidden_size must be a positive integer"),
        ('{"hidden_size": 64}', "field model_type is missing"),
        ("{hidden_size: 64", "not valid JSON"),
        ('{"model_type": "my-own-arch", "auto_map": {"AutoConfig": "x.Y"}}', "--trust-remote-code"),
    ],
    ids=["negative-field", "no-model-type", "not-json", "remote-code"],
)
def test_bad_config_names_what_is_wrong(cli, tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)
    result = cli("estimate", str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr


def test_recipe_file_with_unknown_key(cli, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("per_device_train_batch_size: 2\nlearning_rte: 3\n")
    result = cli("estimate", "--recipe", str(path))
    assert result.returncode == 2
    assert "unknown key learning_rte (did you mean learning_rate?)" in result.stderr


def test_a_prediction_does_not_need_the_methods_package(cli):
    """flash-attn does not install on a machine without CUDA: the estimate proceeds and says what
    training will need."""
    import importlib.util
    import json

    assert importlib.util.find_spec("flash_attn") is None
    result = cli("estimate", "--attn-implementation", "flash_attention_2", "--gpu", "A100-80GB", "--bf16", "--json")
    assert result.returncode == 0, result.stderr
    assert "training this recipe needs flash_attn" in result.stderr
    assert result.stderr.count("flash_attn") == 2  # one line: the package and its pip command
    assert json.loads(result.stdout)["recipe"]["attn_implementation"] == "flash_attention_2"
