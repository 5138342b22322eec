"""TRL's trainers, padding-free training and packing as recipes: token statistics, DPO's reference model,
the files `trl sft/dpo --config` read and the ones `--emit trl` writes, and bad input (issue 23).

The accuracy of the traced steps against real TRL steps is tests/test_trl_accuracy.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.estimate.memory import estimate_memory
from anatomist.hardware import get_gpu
from anatomist.plan.emit import render, write
from anatomist.recipe import Recipe
from anatomist.token_stats import read_lengths
from anatomist.workload_loader import load_workload

GPU = get_gpu("A100-80GB")


def test_expected_longest_of_a_batch_is_the_order_statistic():
    """Lengths 10, 20, 30, 40 drawn twice with replacement: P(longest <= x) = (F(x))^2, F = 1/4, 2/4, 3/4, 1, so
    E[longest] = 10 x 1/16 + 20 x 3/16 + 30 x 5/16 + 40 x 7/16 = (10 + 60 + 150 + 280) / 16 = 31.25."""
    stats = read_lengths_from([10, 20, 30, 40], max_len=64)
    assert stats.expected_longest(2) == pytest.approx(31.25)
    assert stats.expected_longest(1) == pytest.approx(25.0)  # one draw: the mean
    assert stats.padding_share(2) == pytest.approx(1 - 25 / 31.25)  # 20% of the tokens are padding


def read_lengths_from(values: list[int], max_len: int, tmp: Path | None = None):
    import tempfile

    folder = Path(tmp or tempfile.mkdtemp())
    path = folder / "lengths.txt"
    path.write_text("\n".join(map(str, values)) + "\n")
    return read_lengths(str(path), max_len)


def test_lengths_are_truncated_to_the_maximum_as_the_trainers_truncate(tmp_path):
    stats = read_lengths_from([100, 3000, 50], max_len=1024, tmp=tmp_path)
    assert stats.lengths == (100, 1024, 50) and stats.avg_seq_len == round((100 + 1024 + 50) / 3)
    (tmp_path / "l.json").write_text("[5, 7]")
    assert read_lengths(str(tmp_path / "l.json"), 64).mean_tokens == 6


@pytest.mark.parametrize(("text", "message"), [
    ("12\nabc\n", r"line 2 is 'abc', not a positive whole number"),
    ("12\n0\n", r"line 2 is '0'"),
    ("", r"is empty"),
    ("[]", r"no lengths in it"),
    ("[3, -1]", r"entry 2 is -1"),
])
def test_bad_lengths_file_names_the_line(tmp_path, text, message):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        read_lengths(str(path), 64)


def _torch_log(line: str) -> bool:
    """A line torch's own logging writes when a library first imports it here (torchao's registrations), not ours."""
    return line[:1] in "WI" and line[1:5].isdigit()


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama", num_hidden_layers=3)


@pytest.mark.parametrize(("args", "message"), [
    (["--padding-free", "--avg-seq-len", "32"], "padding_free: sequences flattened into one row need an attention"),
    (["--packing", "--padding-free", "--attn-implementation", "sdpa"], "packing: sequences flattened"),
    (["--padding-free", "--attn-implementation", "flash_attention_2"], "give their lengths: --avg-seq-len N or --lengths"),
    (["--avg-seq-len", "100"], "--avg-seq-len 100 is above the maximum length 64"),
    (["--avg-seq-len", "32", "--lengths", "x.txt"], "give one"),
    (["--lengths", "missing.txt"], "no such file"),
    (["--precompute-ref-log-probs"], "needs --trainer dpo"),
    (["--trainer", "dpo", "--padding-free", "--attn-implementation", "flash_attention_2", "--avg-seq-len", "32"],
     "DPOTrainer (trl 1.16) has no padding-free training"),
    (["--trainer", "dpo", "--task", "sequence-classification"], "trains causal language models; this is a sequence-classification"),
    (["--trainer", "dpo", "--prompt-len", "64"], "--prompt-len must be at least 0 and below the sequence length 64"),
])
def test_bad_input_is_one_line(cli, llama, args, message):
    proc = cli("estimate", str(llama), "--seq-len", "64", "--gpu", "A100-80GB", *args, "--json")
    assert proc.returncode == 2, proc.stdout[-300:]
    said = [line for line in proc.stderr.splitlines() if not _torch_log(line)]
    assert message in proc.stderr and len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_padding_free_processes_the_data_s_tokens(cli, llama, tmp_path):
    """5 examples of 64 tokens at most whose mean is 32: padding-free micro-batches are 4 x 32 tokens; padded
    ones are 4 x 64 (the longest batch) and the note says what the padding costs."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("16\n24\n32\n40\n48\n")
    base = ["estimate", str(llama), "--seq-len", "64", "--gpu", "A100-80GB", "--batch-size", "4", "--lengths",
            str(lengths), "--json"]
    padded = json.loads(cli(*base).stdout)
    free = json.loads(cli(*base, "--padding-free", "--attn-implementation", "flash_attention_2").stdout)
    assert padded["seq_len"] == 64 and free["seq_len"] == 32
    assert free["memory"]["activations"] < padded["memory"]["activations"]
    assert free["time"]["tokens_per_second"] * padded["time"]["step_s"] < padded["time"]["tokens_per_second"] * free["time"]["step_s"] * 1.01
    note = next(n for n in padded["notes"] if n.startswith("padding:"))
    # E[longest of 4 draws] = sum x ((i/5)^4 - ((i-1)/5)^4): 16 x 0.0016 + 24 x 0.024 + 32 x 0.104 + 40 x 0.28
    # + 48 x 0.5904 = 43.47; padding 1 - 32 / 43.47 = 26%
    assert "longest has 43 on average: 26% of the tokens" in note
    assert any(n.startswith("padding-free: 4 sequences of 32 tokens") for n in free["notes"])


def test_packing_keeps_full_rows(cli, llama):
    proc = cli("estimate", str(llama), "--seq-len", "64", "--gpu", "A100-80GB", "--packing", "--attn-implementation",
               "flash_attention_2", "--avg-seq-len", "16", "--json")
    out = json.loads(proc.stdout)
    assert out["seq_len"] == 64 and out["recipe"]["padding_free"] is True  # packing is padding-free (TRL's bfd)
    assert any("each about 4.0 sequences" in n for n in out["notes"])


def _weights(workload, **fields) -> int:
    recipe = Recipe.with_presets(per_device_train_batch_size=2, trainer="dpo", dtype="bfloat16", **fields)
    return estimate_memory(workload, recipe.resolved(workload), GPU).anatomy.weights


@pytest.mark.slow
def test_dpo_reference_is_a_copy_only_without_adapters_or_precomputed_log_probs(llama):
    """Full fine-tuning holds the reference as a second copy of the weights; PEFT's base with the adapters
    disabled is the reference (no copy); precomputed log-probabilities need none."""
    workload = load_workload(str(llama), seq_len=32)
    alone = _weights(workload, precompute_ref_log_probs=True)
    with_copy = _weights(workload)
    # a bf16 copy of every parameter and buffer: 3 blocks of tiny Llama (conftest.py) plus embeddings and head
    assert with_copy - alone == pytest.approx(alone, rel=0.01)
    lora = _weights(workload, peft="lora")
    assert lora < with_copy * 0.6


def test_dpo_config_yaml_is_read_as_trl_dpo_reads_it(llama, tmp_path):
    from trl import DPOConfig, ModelConfig

    dpo = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_length=64, use_cpu=True,
                    report_to="none", precompute_ref_log_probs=True, beta=0.05)
    model = ModelConfig(model_name_or_path=str(llama), dtype="bfloat16")
    path = tmp_path / "dpo.yaml"
    import dataclasses

    path.write_text(yaml.safe_dump({**dpo.to_dict(), **dataclasses.asdict(model)}))
    from anatomist.recipe.files import read_recipe_file

    source = read_recipe_file(path)
    assert source.kind == "TRL" and source.model == str(llama) and source.seq_len == 64
    assert source.recipe.trainer == "dpo" and source.recipe.precompute_ref_log_probs
    assert source.recipe.gradient_checkpointing == dpo.gradient_checkpointing  # DPOConfig's default, not the Trainer's
    assert "beta" in source.not_modelled


def test_a_dpo_yaml_with_a_field_of_an_older_trl_is_read_and_the_field_named(tmp_path):
    """max_prompt_length is a DPOConfig field of trl releases before 1.0 (issue 27: fields of any release of the
    last two years are accepted and named as not modelled); beta makes it `trl dpo`'s file."""
    from anatomist.recipe.files import read_recipe_file

    path = tmp_path / "dpo.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nbeta: 0.1\nmax_prompt_length: 512\n")
    read = read_recipe_file(path)
    assert read.recipe.trainer == "dpo" and "max_prompt_length" in read.not_modelled


@pytest.mark.parametrize("fields", [{"trainer": "dpo", "precompute_ref_log_probs": True, "peft": "lora"},
                                    {"trainer": "sft", "packing": True, "attn_implementation": "flash_attention_2"},
                                    {"trainer": "sft", "padding_free": True, "attn_implementation": "flash_attention_2",
                                     "use_liger_kernel": True}])
def test_emitted_trl_yaml_is_read_by_trl_s_parser(tmp_path, fields):
    """`--emit trl` of a DPO recipe is what `trl dpo --config` parses (DPOConfig), of an SFT one `trl sft`'s."""
    from trl import DPOConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    recipe = Recipe.with_presets(per_device_train_batch_size=2, bf16=True, **fields)
    path = tmp_path / "trl.yaml"
    write(recipe, "trl", path, model="Qwen/Qwen2.5-0.5B", seq_len=1024)
    config = DPOConfig if recipe.trainer == "dpo" else SFTConfig
    _, args, model = TrlParser((ScriptArguments, config, ModelConfig)).parse_args_and_config(
        args=["--config", str(path), "--use_cpu", "true"])
    if recipe.trainer == "dpo":
        assert args.precompute_ref_log_probs and model.use_peft
    else:
        assert args.padding_free and args.packing == recipe.packing and args.use_liger_kernel == recipe.use_liger_kernel
        assert args.max_length == (1024 if recipe.packing else None)  # TRL refuses max_length padding-free unpacked
    assert model.attn_implementation == recipe.attn_implementation
    assert yaml.safe_load(render(recipe, "trl"))["per_device_train_batch_size"] == 2


@pytest.mark.slow
def test_plan_for_dpo_keeps_the_trainer_and_emits_trl_dpo_yaml(cli, llama, tmp_path):
    out = tmp_path / "dpo.yaml"
    proc = cli("plan", str(llama), "--seq-len", "32", "--gpu", "A100-80GB", "--global-batch-size", "4",
               "--trainer", "dpo", "--peft", "lora", "--optims", "adamw_torch_fused", "--no-compile", "--precisions",
               "bf16-weights", "--no-liger-kernel", "--json", "--emit", "trl", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)["best"]["recipe"]
    assert best["trainer"] == "dpo"
    assert yaml.safe_load(out.read_text())["per_device_train_batch_size"] == best["per_device_train_batch_size"]


def test_liger_under_trl_keeps_its_layer_kernels_only(cli, llama):
    """TRL's trainers set liger_kernel_config fused_linear_cross_entropy=False (their own fused head scores the
    tokens): the note says so instead of describing Liger's chunked loss."""
    proc = cli("estimate", str(llama), "--seq-len", "64", "--gpu", "A100-80GB", "--trainer", "sft", "--use-liger-kernel",
               "--json")
    notes = json.loads(proc.stdout)["notes"]
    liger = next(n for n in notes if n.startswith("Liger Kernel"))
    assert "TRL turns its fused linear + cross-entropy off" in liger and "chunk of" not in liger
    assert any(n.startswith("TRL's SFTTrainer") for n in notes)
