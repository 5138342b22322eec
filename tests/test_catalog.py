"""The shipped catalog: every entry names its Hub repo and published size, and builds to that size.

Each entry is built on the meta device (no memory, no weights) with the class its checkpoint
uses, and its parameter count must land within the entry's tolerance (0.5% unless it says
otherwise) of the count its authors publish: a mistyped field (a wrong intermediate_size, a
layer too many, untied embeddings) moves the count by more than that.
"""

from __future__ import annotations

import json

import pytest

from anatomist.cli import main
from anatomist.model_catalog import catalog_entries, find_entry, summarize
from anatomist.model_facts import facts_of
from anatomist.workload import config_from_dict, load_workload

ENTRIES = sorted(catalog_entries())


def checkpoint_parameters(name: str) -> int:
    """Parameters of the entry's checkpoint class built on the meta device, tied weights once.

    The class is the config's `architectures[0]` (what the Hub checkpoint holds), else the causal
    LM, else the bare model. transformers 5 ties T5's lm_head to the shared embedding whatever the
    config says (configuration_t5.py); a checkpoint whose config says tie_word_embeddings=false
    stores it apart, so it is counted apart.
    """
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    entry = catalog_entries()[name]
    config = config_from_dict(dict(entry.config), name, trust_remote_code=False)
    architectures = entry.config.get("architectures") or []
    with torch.device("meta"):
        if architectures and hasattr(transformers, architectures[0]):
            model = getattr(transformers, architectures[0])._from_config(config)
        elif type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
            model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            model = transformers.AutoModel.from_config(config)
    count = model.num_parameters()
    output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if entry.config.get("tie_word_embeddings") is False and output is not None and output.weight is embeddings.weight:
        count += output.weight.numel()
    return count


def test_every_entry_names_its_hub_repo_and_sources():
    for entry in catalog_entries().values():
        assert "/" in entry.hub_id, entry.name
        assert entry.parameters > 0, entry.name
        assert entry.parameters_source and entry.config_source, entry.name
        assert 0 < entry.tolerance <= 0.01, entry.name  # 1% at most: looser catches no mistyped field


def test_a_checkpoint_dtype_is_recorded_only_where_the_config_names_none():
    """`--dtype auto` of DeepSeek-V2-Lite and gpt-oss-20b loads their bf16 checkpoints in bfloat16, as
    from_pretrained(dtype="auto") does from the checkpoint where the config names no dtype; a config with a dtype
    keeps its own."""
    from anatomist.workload import load_workload

    recorded = {e.name for e in catalog_entries().values() if e.checkpoint_dtype is not None}
    assert {"DeepSeek-V2-Lite", "gpt-oss-20b"} <= recorded
    for name in recorded:
        entry = catalog_entries()[name]
        assert "torch_dtype" not in entry.config and "dtype" not in entry.config, name
        assert entry.checkpoint_dtype in ("float32", "bfloat16", "float16") and entry.checkpoint_dtype_source, name
        assert load_workload(name).config_dtype == entry.checkpoint_dtype
    assert load_workload("bert-base-uncased").config_dtype == "float32"  # no dtype anywhere: float32


@pytest.mark.parametrize("name", ENTRIES)
def test_built_model_matches_the_published_parameter_count(name):
    from transformers import CONFIG_MAPPING

    entry = catalog_entries()[name]
    if entry.model_type not in CONFIG_MAPPING:
        pytest.skip(f"model_type {entry.model_type!r} is not in the installed transformers")
    built = checkpoint_parameters(name)
    error = abs(built - entry.parameters) / entry.parameters
    assert error <= entry.tolerance, (
        f"{name}: built {built:,} vs published {entry.parameters:,} ({error:.3%} > {entry.tolerance:.1%})"
    )


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("Qwen/Qwen3-8B", "Qwen3-8B"),
        ("qwen3-30b-a3b", "Qwen3-30B-A3B"),
        ("openai/gpt-oss-20b", "gpt-oss-20b"),
        ("google-bert/bert-large-uncased", "bert-large-uncased"),
        ("mistralai/Mixtral-8x7B", "Mixtral-8x7B-v0.1"),
    ],
)
def test_entries_resolve_by_name_and_hub_id(model, name):
    assert find_entry(model).name == name
    assert load_workload(model).source == "catalog"


def test_catalog_metadata_never_reaches_transformers():
    config = load_workload("Qwen3-8B").config
    assert not hasattr(config, "_anatomist")
    assert "_anatomist" not in config.to_json_string()


@pytest.mark.parametrize("name", ENTRIES)
def test_summary_read_from_the_json_is_the_one_transformers_config_gives(name: str) -> None:
    """`anatomist models` reads the config.json alone; transformers' config (aliases such as GPT-2's
    n_layer, class defaults) is the truth it must match, for every entry."""
    entry = catalog_entries()[name]
    config = config_from_dict(dict(entry.config), name, trust_remote_code=False)
    text = config.get_text_config()
    workload = load_workload(name)
    summary = summarize(entry)
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    assert summary.layers == text.num_hidden_layers
    assert summary.decoder_layers == (text.num_decoder_layers if encoder_decoder else None)
    assert summary.context_length == workload.max_positions
    assert (summary.experts_per_token, summary.experts) == (facts_of(config).experts or (None, None))
    for field, value in entry.defaults.items():
        assert field not in entry.config and getattr(text, field) == value


def test_summary_of_moe_encoder_decoder_and_text_models():
    moe = summarize(catalog_entries()["Qwen3-30B-A3B"])
    assert (moe.family, moe.layers, moe.experts, moe.experts_per_token, moe.is_moe) == ("qwen3_moe", 48, 128, 8, True)
    assert summarize(catalog_entries()["DeepSeek-V2-Lite"]).experts == 64  # n_routed_experts
    t5 = summarize(catalog_entries()["t5-efficient-small-el32"])
    assert (t5.layers, t5.decoder_layers) == (32, 6)
    gemma = summarize(catalog_entries()["gemma-3-27b-pt-text"])
    assert (gemma.family, gemma.layers, gemma.context_length, gemma.is_moe) == ("gemma3_text", 62, 131072, False)
    # RoBERTa's position ids start after the padding index: 514 embeddings hold 512 tokens
    assert summarize(catalog_entries()["roberta-large"]).context_length == 512


def test_models_command_lists_family_size_layers_context_and_moe(capsys, monkeypatch):
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}
    assert set(rows) == set(ENTRIES)
    llama = rows["Llama-3.3-70B-Instruct"]
    assert llama["hub_id"] == "meta-llama/Llama-3.3-70B-Instruct"
    assert (llama["family"], llama["parameters"], llama["layers"], llama["context_length"], llama["moe"]) == (
        "llama", 70_553_706_496, 80, 131072, False)
    assert rows["gpt-oss-20b"]["moe"] and rows["gpt-oss-20b"]["experts"] == 32

    assert main(["models"]) == 0  # captured: not a terminal, one row per line
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["Qwen3-30B-A3B"][-1] == "8/128" and lines["t5-efficient-small-el32"][4] == "32+6"
