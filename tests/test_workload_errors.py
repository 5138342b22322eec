"""Config loading: refuse what would break the estimate (one line, exit 2), never what transformers builds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from anatomist.cli import main
from anatomist.errors import InputError
from anatomist.workload_loader import load_workload

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def estimate_error(capsys, *argv: str) -> str:
    """Run `anatomist estimate ...` in-process; it must fail with exit 2 and one line on stderr."""
    assert main(["estimate", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def test_real_albert_base_v2_config_loads(tmp_path):
    # gap_size 0, num_memory_blocks 0: ALBERT's own values, refused by the old "*_size > 0" guess
    shutil.copy(FIXTURES / "albert-base-v2.json", tmp_path / "config.json")
    workload = load_workload(str(tmp_path), seq_len=128)
    assert workload.model_type == "albert"
    assert (workload.config.gap_size, workload.config.num_hidden_layers, workload.max_positions) == (0, 12, 512)


def test_deberta_v3_negative_max_relative_positions_and_zero_type_vocab_load(tmp_path):
    # microsoft/deberta-v3-base's own values: type_vocab_size 0 (no segment embedding),
    # max_relative_positions -1 ("use max_position_embeddings")
    path = write(tmp_path / "deberta", {
        "model_type": "deberta-v2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512, "relative_attention": True,
        "position_buckets": 256, "norm_rel_ebd": "layer_norm", "share_att_key": True, "pos_att_type": "p2c|c2p",
        "max_relative_positions": -1, "position_biased_input": False, "type_vocab_size": 0})
    config = load_workload(str(path), seq_len=128).config
    assert (config.type_vocab_size, config.max_relative_positions) == (0, -1)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("llama", {"num_hidden_layers": 0}, "field num_hidden_layers must be a positive integer, got 0"),
        ("llama", {"hidden_size": -64}, "field hidden_size must be a positive integer, got -64"),
        ("llama", {"vocab_size": 0}, "field vocab_size must be a positive integer, got 0"),
        ("bert", {"num_attention_heads": 0}, "field num_attention_heads must be a positive integer, got 0"),
        ("gpt2", {"n_layer": 0}, "field n_layer must be a positive integer, got 0"),  # GPT-2 spells it n_layer
        ("gpt2", {"n_embd": 64.5}, "field n_embd must be a positive integer, got 64.5"),
        ("llama", {"hidden_size": "wide"}, "field hidden_size must be a positive integer, got 'wide'"),
    ],
)
def test_sizes_the_estimate_needs_must_be_positive(tiny_model, capsys, name, overrides, message):
    path = tiny_model(name, **overrides)
    with pytest.raises(InputError, match=message):
        load_workload(str(path))
    assert message in estimate_error(capsys, str(path))


def test_t5_decoder_depth_is_checked_too(tmp_path):
    path = write(tmp_path / "t5", {"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2,
                                   "num_decoder_layers": 0, "num_heads": 2, "vocab_size": 100})
    with pytest.raises(InputError, match="field num_decoder_layers must be a positive integer, got 0"):
        load_workload(str(path))


def test_unknown_architecture_names_its_model_type(tmp_path, capsys):
    path = write(tmp_path / "m", {"model_type": "lama", "hidden_size": 64})
    line = estimate_error(capsys, str(path))
    assert "unknown architecture model_type='lama'" in line
    assert "did you mean llama" in line


def test_architecture_no_transformers_knows_says_so(tmp_path):
    path = write(tmp_path / "m", {"model_type": "my-own-arch-2031", "hidden_size": 64})
    with pytest.raises(InputError, match=r"unknown architecture model_type='my-own-arch-2031' \(transformers \d"):
        load_workload(str(path))


def test_remote_code_needs_the_flag(tmp_path, capsys):
    path = write(tmp_path / "m", {"model_type": "my-own-arch", "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    line = estimate_error(capsys, str(path))
    assert "model_type='my-own-arch' needs the model's own code (auto_map)" in line
    assert "--trust-remote-code" in line


def test_remote_code_with_the_flag_but_no_code_is_one_line(tmp_path, capsys):
    path = write(tmp_path / "m", {"model_type": "my-own-arch", "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    line = estimate_error(capsys, str(path), "--trust-remote-code")
    assert "cannot load its remote config code" in line


def test_a_native_model_with_auto_map_needs_no_flag(tiny_model):
    # many Hub configs keep an auto_map after transformers added the architecture (Phi-3, DeepSeek-V2)
    path = tiny_model("llama", auto_map={"AutoConfig": "configuration_llama.LlamaConfig"})
    assert load_workload(str(path)).model_type == "llama"


def test_a_value_transformers_rejects_is_one_line_naming_the_field(tiny_model, capsys):
    line = estimate_error(capsys, str(tiny_model("llama", rms_norm_eps="tiny")))
    assert "invalid config: Validation error for field 'rms_norm_eps'" in line


@pytest.mark.parametrize(
    ("model", "seq_len", "message"),
    [
        ("gpt2", "1025", "seq_len 1025 is above gpt2's maximum of 1024 positions"),
        ("Llama-3.2-1B", "131073", "seq_len 131073 is above Llama-3.2-1B's maximum of 131072 positions"),
    ],
)
def test_sequence_length_beyond_the_maximum(capsys, model, seq_len, message):
    assert message in estimate_error(capsys, model, "--seq-len", seq_len)


def test_roberta_positions_start_after_the_padding_index(tmp_path, capsys):
    # RoBERTa's 514 position embeddings hold 512 tokens: ids start at padding_idx + 1 = 2
    path = write(tmp_path / "roberta", {
        "model_type": "roberta", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 514, "pad_token_id": 1})
    assert load_workload(str(path)).max_positions == 512
    assert "seq_len 513 is above" in estimate_error(capsys, str(path), "--seq-len", "513")


@pytest.mark.parametrize(
    ("model", "task"),
    [
        ("ModernBERT-base", "sequence-classification"),  # no causal-LM class in transformers
        ("roberta-large", "sequence-classification"),  # has RobertaForCausalLM, still an encoder
        ("Qwen3-8B", "causal-lm"),
        ("flan-t5-base", "seq2seq-lm"),
    ],
)
def test_default_task_follows_the_architecture(model, task):
    assert load_workload(model).task == task


def test_a_model_in_the_local_hf_cache_is_found_and_one_missing_is_one_line(tiny_model, tmp_path: Path,
                                                                              monkeypatch, capsys) -> None:
    """The cache as huggingface_hub lays it out: refs/main names the snapshot that holds config.json."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--someone--tiny-bert"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_model("bert") / "config.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    workload = load_workload("someone/tiny-bert", seq_len=32)
    assert workload.source == "hf-cache" and workload.model_type == "bert"
    for missing in ("someone/other-bert", "not a repo id"):
        line = estimate_error(capsys, missing, "--seq-len", "32")
        assert line.startswith(f"anatomist: error: unknown model {missing!r}: not a path, not in the catalog, "
                               "not in the local HF cache")
