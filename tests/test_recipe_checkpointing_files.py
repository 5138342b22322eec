"""Activation checkpointing options in real config files (tests/data/README.md), read by `--recipe`.

What each file sets is read here with yaml; what the option does is its framework's:
- TrainingArguments.gradient_checkpointing_kwargs (the alignment handbook's recipes, LLaMA-Factory's
  mossvl example): passed to torch.utils.checkpoint, except `every_n_layers` and `offload`, which
  transformers takes for itself (`Recipe.checkpoint_every`, `Recipe.checkpoint_offload`); `use_reentrant`
  changes no memory.
- LLaMA-Factory's use_unsloth_gc (model/model_utils/checkpointing.py): Unsloth's checkpointing, each
  checkpointed layer's input on the host. No example of LLaMA-Factory's sets it: it is added to a real file.
- axolotl (at the commit in tests/data/README.md): gradient_checkpointing_kwargs go to TrainingArguments;
  activation_offloading true runs TRL's activation offloader (every saved activation to the host: for full
  fine-tuning on the layers axolotl checkpoints, `Recipe.activation_offloading`; with an adapter axolotl's own
  variant in place of recomputation, refused in one line: core/trainers/mixins/activation_checkpointing.py,
  loaders/model.py); gradient_checkpointing: offload is axolotl's deprecated spelling of activation_offloading:
  true (utils/schemas/validation.py); legacy (no streams) and disk are refused.
  activation_offloading: hidden_states moves only each checkpointed layer's input (docs/gradient_checkpointing.qmd):
  `checkpoint_offload`. No axolotl example sets hidden_states: it is set on a real file.

No real file found sets transformers' activation_checkpointing_kwargs (every_n_layers, offload): those are
tested on inline snippets in test_recipe_strictness.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from anatomist.errors import InputError
from anatomist.recipe.files import read_recipe_file

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


def _one_line_error(cli, path: Path) -> str:
    """What `anatomist estimate --recipe PATH` says when it refuses the file: one line, exit status 2."""
    result = cli("estimate", "--recipe", str(path))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line.removeprefix("anatomist: error: ")


def test_axolotl_activation_offloading_with_an_adapter_is_refused_in_one_line(cli) -> None:
    path = DATA / "axolotl" / "32b-qlora.yaml"  # gradient_checkpointing: offload, with gradient_checkpointing_kwargs
    raw = yaml.safe_load(path.read_text())
    assert raw["gradient_checkpointing"] == "offload" and raw["adapter"] == "qlora"
    with pytest.raises(InputError):
        read_recipe_file(path)
    line = _one_line_error(cli, path)
    assert line.startswith(f"{path}: gradient_checkpointing='offload' with an adapter runs axolotl's own variant of "
                           "TRL's offloader"), line
    assert line.endswith("remove it to estimate without it"), line


@pytest.mark.parametrize("value", ["legacy", "disk"])
def test_axolotl_offloading_without_streams_or_to_disk_is_refused(tmp_path: Path, value: str) -> None:
    raw = yaml.safe_load((DATA / "axolotl/3b-qat-mxfp4.yaml").read_text())
    del raw["qat"]
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump({**raw, "activation_offloading": value}))
    with pytest.raises(InputError, match=f"activation_offloading={value!r} is not modelled yet"):
        read_recipe_file(path)


def test_axolotl_activation_offloading_of_full_fine_tuning_is_trls(tmp_path: Path) -> None:
    raw = yaml.safe_load((DATA / "axolotl" / "3b-qat-mxfp4.yaml").read_text())
    assert raw["activation_offloading"] is True and raw.get("adapter") is None
    with pytest.raises(InputError, match="qat is not modelled yet"):  # the file's quantization-aware training
        read_recipe_file(DATA / "axolotl" / "3b-qat-mxfp4.yaml")
    del raw["qat"]
    path = tmp_path / "3b.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = read_recipe_file(path).recipe
    assert (r.activation_offloading, r.gradient_checkpointing, r.checkpoint_offload) == (True, True, False)


def test_axolotl_activation_offloading_false_is_off(tmp_path: Path) -> None:
    raw = yaml.safe_load((DATA / "axolotl/v4-flash-nvfp4-lora.yaml").read_text())
    assert raw["activation_offloading"] is False and raw["gradient_checkpointing"] is True
    del raw["plugins"]  # Cut Cross-Entropy and KernelsPlugin: not what this test reads
    path = tmp_path / "v4.yaml"
    path.write_text(yaml.safe_dump(raw))
    source = read_recipe_file(path)
    r = source.recipe
    assert (r.gradient_checkpointing, r.checkpoint_every, r.checkpoint_offload) == (True, 1, False)
    assert "activation_offloading" not in source.not_modelled and "gradient_checkpointing_kwargs" not in source.not_modelled


def test_axolotl_hidden_states_offloading_is_checkpoint_offload(tmp_path: Path) -> None:
    raw = yaml.safe_load((DATA / "axolotl/3b-qat-mxfp4.yaml").read_text())
    del raw["qat"]
    path = tmp_path / "3b-hidden-states.yaml"
    path.write_text(yaml.safe_dump({**raw, "activation_offloading": "hidden_states"}))
    r = read_recipe_file(path).recipe
    assert (r.gradient_checkpointing, r.checkpoint_every, r.checkpoint_offload) == (True, 1, True)
    # axolotl: "activation_offloading requires gradient_checkpointing" (validation.py); so does the Recipe
    path.write_text(yaml.safe_dump({**raw, "activation_offloading": "hidden_states", "gradient_checkpointing": False}))
    with pytest.raises(InputError, match="checkpoint_offload is a setting of gradient checkpointing"):
        read_recipe_file(path)


@pytest.mark.parametrize(("name", "reentrant"), [("fft-8b-liger-fsdp.yaml", False), ("qlora-fsdp-70b.yaml", True)])
def test_axolotl_gradient_checkpointing_kwargs_are_read_as_training_arguments(name: str, reentrant: bool,
                                                                               tmp_path: Path) -> None:
    path = DATA / "axolotl" / name
    raw = yaml.safe_load(path.read_text())
    assert raw["gradient_checkpointing_kwargs"] == {"use_reentrant": reentrant}
    source = read_recipe_file(path)
    assert (source.recipe.checkpoint_every, source.recipe.checkpoint_offload) == (1, False)
    assert "gradient_checkpointing_kwargs" not in source.not_modelled  # read: use_reentrant changes no memory
    # axolotl passes the mapping to TrainingArguments, where transformers takes every_n_layers for itself
    raw["gradient_checkpointing_kwargs"]["every_n_layers"] = 2
    partial = tmp_path / name
    partial.write_text(yaml.safe_dump(raw))
    assert read_recipe_file(partial).recipe.checkpoint_every == 2
