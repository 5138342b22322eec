"""Activation checkpointing options in real config files (tests/data/README.md), read by `--recipe`.

What each file sets is read here with yaml; what the option does is its framework's:
- TrainingArguments.gradient_checkpointing_kwargs (the alignment handbook's recipes, LLaMA-Factory's
  mossvl example): passed to torch.utils.checkpoint, except `every_n_layers` and `offload`, which
  transformers takes for itself (`Recipe.checkpoint_every`, `Recipe.checkpoint_offload`); `use_reentrant`
  changes no memory.
- LLaMA-Factory's use_unsloth_gc (model/model_utils/checkpointing.py): Unsloth's checkpointing, each
  checkpointed layer's input on the host. No example of LLaMA-Factory's sets it: it is added to a real file.

No real file found sets transformers' activation_checkpointing_kwargs (every_n_layers, offload): those are
tested on inline snippets in test_recipe_strictness.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from anatomist.recipe_files import read_recipe_file

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(("name", "trainer", "reentrant"), [
    ("smollm2_sft_config.yaml", "sft", False),
    ("smollm2_dpo_config.yaml", "dpo", False),  # written `use_reentrant: False`: YAML's false too
    ("smollm3_sft_mid.yaml", "sft", True),
])
def test_handbook_gradient_checkpointing_kwargs_are_read(name: str, trainer: str, reentrant: bool,
                                                         tmp_path: Path) -> None:
    path = DATA / "alignment-handbook" / name
    raw = yaml.safe_load(path.read_text())
    assert raw["gradient_checkpointing"] is True and raw["gradient_checkpointing_kwargs"] == {"use_reentrant": reentrant}
    source = read_recipe_file(path)
    r = source.recipe
    assert (source.kind, r.trainer) == ("TRL", trainer)
    # every layer checkpointed, its input kept on the GPU: use_reentrant is read and changes nothing
    assert (r.gradient_checkpointing, r.checkpoint_every, r.checkpoint_offload) == (True, 1, False)
    assert "gradient_checkpointing_kwargs" not in source.not_modelled
    # the same mapping with transformers' own offload key beside use_reentrant: read from where the file has it
    raw["gradient_checkpointing_kwargs"]["offload"] = True
    offloaded = tmp_path / name
    offloaded.write_text(yaml.safe_dump(raw))
    assert read_recipe_file(offloaded).recipe.checkpoint_offload


def _beside_its_deepspeed_config(raw: dict, tmp_path: Path) -> Path:
    """A changed copy of a LLaMA-Factory example, beside the examples/deepspeed/ config it names."""
    (tmp_path / "examples").symlink_to(DATA / "llamafactory/examples")
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_llamafactory_mossvl_gradient_checkpointing_kwargs(tmp_path: Path) -> None:
    path = DATA / "llamafactory/mossvl_full_sft.yaml"
    raw = yaml.safe_load(path.read_text())
    assert raw["gradient_checkpointing_kwargs"] == {"use_reentrant": False} and "use_unsloth_gc" not in raw
    source = read_recipe_file(path)
    r = source.recipe
    assert (source.kind, source.model, source.seq_len) == ("LLaMA-Factory", raw["model_name_or_path"], raw["cutoff_len"])
    assert (r.gradient_checkpointing, r.checkpoint_every, r.checkpoint_offload) == (True, 1, False)
    assert r.zero_stage == 3 and r.peft == "none" and r.dtype == "float32"  # full: float32 trainable weights
    # use_unsloth_gc, as LLaMA-Factory documents it (model_args.py), on this real example
    unsloth = read_recipe_file(_beside_its_deepspeed_config({**raw, "use_unsloth_gc": True}, tmp_path)).recipe
    assert (unsloth.gradient_checkpointing, unsloth.checkpoint_offload) == (True, True)
