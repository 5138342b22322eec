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
from anatomist.errors import InputError
from anatomist.model_catalog import catalog_aliases, catalog_entries, find_entry, resolve, summarize
from anatomist.model_config import config_from_dict
from anatomist.model_facts import facts_of
from anatomist.workload_loader import load_workload

ENTRIES = sorted(catalog_entries())
ALIASES = list(catalog_aliases())


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
    from anatomist.workload_loader import load_workload

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
    listing = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in listing["models"]}
    assert set(rows) == set(ENTRIES)
    llama = rows["Llama-3.3-70B-Instruct"]
    assert llama["hub_id"] == "meta-llama/Llama-3.3-70B-Instruct"
    assert (llama["family"], llama["parameters"], llama["layers"], llama["context_length"], llama["moe"]) == (
        "llama", 70_553_706_496, 80, 131072, False)
    assert rows["gpt-oss-20b"]["moe"] and rows["gpt-oss-20b"]["experts"] == 32
    assert "meta-llama/Llama-3.1-8B-Instruct" in rows["Llama-3.1-8B"]["aliases"]
    aliases = {row["hub_id"]: row for row in listing["aliases"]}
    assert set(aliases) == set(ALIASES)
    assert aliases["NousResearch/Meta-Llama-3-8B"] | {"source": ""} == {
        "name": "Meta-Llama-3-8B", "hub_id": "NousResearch/Meta-Llama-3-8B", "config": "Meta-Llama-3-8B",
        "kind": "re-upload", "differs": None, "source": ""}

    assert main(["models"]) == 0  # captured: not a terminal, one row per line; the aliases after a blank line
    models, _, alias_block = capsys.readouterr().out.partition("\n\n")
    lines = {line.split()[0]: line.split() for line in models.splitlines()[1:]}
    assert lines["Qwen3-30B-A3B"][-1] == "8/128" and lines["t5-efficient-small-el32"][4] == "32+6"
    alias_lines = [line.split() for line in alias_block.splitlines()]
    assert alias_lines[0] == ["alias", "config", "kind"]
    assert ["HuggingFaceTB/SmolLM3-3B-checkpoints", "SmolLM3-3B", "checkpoints"] in alias_lines


# --- aliases: names people type (data/model_aliases.toml) ---


@pytest.mark.parametrize("hub_id", ALIASES)
def test_an_alias_differs_from_its_config_in_nothing_that_changes_memory_or_time(hub_id: str) -> None:
    """Its config.json's other values, applied to the entry's, leave the model built, its context, load dtype,
    vocabulary and experts as they were: a variant differing in any of them must ship its own config."""
    alias = catalog_aliases()[hub_id]
    entry = catalog_entries()[alias.config]
    assert "/" in hub_id and hub_id.lower() not in {e.hub_id.lower() for e in catalog_entries().values()}
    assert alias.source
    if alias.differs is None:  # not compared: the note must say so (test_an_alias_estimate_says_which_config)
        return
    config = config_from_dict(dict(entry.config), entry.name, trust_remote_code=False)
    variant = config_from_dict(dict(entry.config) | alias.differs, hub_id, trust_remote_code=False)
    for name, value in alias.differs.items():
        assert getattr(variant, name) == value != getattr(config, name, None), name  # a real difference, as written
    assert facts_of(variant) == facts_of(config)
    import torch
    import transformers

    with torch.device("meta"):
        built = [getattr(transformers, entry.config["architectures"][0])._from_config(c).num_parameters()
                 for c in (config, variant)]
    assert built[0] == built[1]


def test_a_variant_whose_dtype_differs_would_be_refused_as_an_alias() -> None:
    """The rule above catches what it is for: gemma-2-2b-it's bfloat16 file against gemma-2-2b's float32 one."""
    base, it = catalog_entries()["gemma-2-2b"], catalog_entries()["gemma-2-2b-it"]
    differs = {k: v for k, v in it.config.items() if base.config.get(k) != v}
    assert differs == {"eos_token_id": [1, 107], "torch_dtype": "bfloat16"}
    facts = [facts_of(config_from_dict(data, "gemma-2", trust_remote_code=False))
             for data in (dict(base.config), dict(base.config) | differs)]
    assert (facts[0].config_dtype, facts[1].config_dtype) == ("float32", "bfloat16")


@pytest.mark.parametrize(
    ("model", "config", "hub_id"),
    [  # the names of the issue, as axolotl, LLaMA-Factory and alignment-handbook files give them
        ("Llama-3.1-8B-Instruct", "Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"),
        ("meta-llama/Meta-Llama-3-8B", "Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),
        ("NousResearch/Meta-Llama-3-8B", "Meta-Llama-3-8B", "NousResearch/Meta-Llama-3-8B"),
        ("Qwen/Qwen3-4B-Instruct-2507", "Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B-Instruct-2507"),
        ("HuggingFaceTB/SmolLM3-3B-checkpoints", "SmolLM3-3B", "HuggingFaceTB/SmolLM3-3B-checkpoints"),
        ("meta-llama/meta-llama-3-8b-instruct", "Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),
        ("Meta-Llama-3-8B-Instruct", "Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),  # Meta's, listed first
        ("Mistral-7B-Instruct", "Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    ],
)
def test_names_people_type_resolve_offline(model: str, config: str, hub_id: str) -> None:
    workload = load_workload(model)
    assert (workload.source, find_entry(model).name, workload.repo_id) == ("catalog", config, hub_id)
    assert workload.config_json == {k: v for k, v in catalog_entries()[config].config.items()}
    if hub_id == catalog_entries()[config].hub_id:
        assert workload.config_note is None
    else:
        assert workload.config_note.startswith(f"{model}: the config of catalog entry {config} ")


def test_an_alias_estimate_says_which_config_stands_in_and_what_differs() -> None:
    note = load_workload("Llama-3.1-8B-Instruct").config_note
    assert note == ("Llama-3.1-8B-Instruct: the config of catalog entry Llama-3.1-8B (meta-llama/Llama-3.1-8B) stands "
                    "in for meta-llama/Llama-3.1-8B-Instruct (instruct), whose config.json differs only in "
                    "eos_token_id=[128001, 128008, 128009]: nothing that changes memory or time")
    distill = load_workload("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B").config_note
    assert "(fine-tune), whose config.json sets the same architecture and sizes" in distill
    unchecked = load_workload("HuggingFaceTB/SmolLM3-3B-checkpoints").config_note
    assert "(checkpoints: SmolLM3-3B's intermediate checkpoints" in unchecked
    assert "its own config.json sets otherwise is not modelled" in unchecked


def test_another_organisations_repo_of_an_aliased_name_is_not_assumed_the_same() -> None:
    assert resolve("someone/Llama-3.1-8B-Instruct") is None
    assert resolve("NousResearch/Llama-3.1-8B") is None  # NousResearch's listed re-uploads are Llama 3's only


def test_a_name_of_several_models_is_one_line(capsys) -> None:
    several = (r"'Mistral-7B' names several catalog models: Mistral-7B-v0.1 \(mistralai/Mistral-7B-v0.1\), "
               r"Mistral-7B-v0.3 \(mistralai/Mistral-7B-v0.3\)")
    with pytest.raises(InputError, match=several):
        resolve("Mistral-7B")
    assert main(["estimate", "Mistral-7B"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("give one of them")


@pytest.mark.parametrize(
    ("model", "close"),
    [
        ("Qwen3-4B-Instruct", "Qwen3-4B-Instruct-2507"),
        ("meta-llama/Llama-3-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        ("llama3.1-8b-instruct", "Llama-3.1-8B-Instruct"),
    ],
)
def test_an_unknown_name_lists_the_closest_catalog_names_in_its_line(capsys, model: str, close: str) -> None:
    assert main(["estimate", model]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0]
    assert lines[0].startswith(f"anatomist: error: unknown model {model!r}: not a path, not in the catalog")
    hint = lines[0].split("did you mean ", 1)[1]
    assert close in hint.split("?")[0].split(", ")


def test_an_alias_in_the_local_hf_cache_uses_its_own_config(tmp_path, monkeypatch) -> None:
    """The repo's own file beats the stand-in: the catalog config is for when it is not there."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    own = dict(catalog_entries()["Llama-3.1-8B"].config) | {"eos_token_id": [128001, 128008, 128009]}
    (snapshot / "config.json").write_text(json.dumps(own))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    workload = load_workload("Llama-3.1-8B-Instruct")
    assert (workload.source, workload.config_note, workload.repo_id) == (
        "hf-cache", None, "meta-llama/Llama-3.1-8B-Instruct")
    assert workload.config_json["eos_token_id"] == [128001, 128008, 128009]


@pytest.mark.slow
def test_an_alias_estimate_leads_its_notes_with_the_config_used(capsys) -> None:
    assert main(["estimate", "HuggingFaceTB/SmolLM2-135M", "--gpu", "A100-80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "HuggingFaceTB/SmolLM2-135M"
    assert out["notes"][0].startswith("HuggingFaceTB/SmolLM2-135M: the config of catalog entry SmolLM2-135M-Instruct")
    assert "differs only in bos_token_id=0, eos_token_id=0" in out["notes"][0]
