"""MODEL's config.json: where it is found, what is refused in it, and the transformers config it describes.

MODEL resolves, in this order, from a local directory or config.json, the shipped catalog
(`anatomist models`, by file name or Hub id, or through an alias: an instruct variant or re-upload whose config the
catalog entry stands in for, said in the estimate's notes), and the local Hugging Face cache. The network is
used only when the caller passes `allow_network=True`; remote model code runs only with
`trust_remote_code=True`.

The catalog is `anatomist/data/models/NAME.json`: the model's Hub config.json plus one key,
`"_anatomist"`, that names the Hub repo, the parameter count its authors publish and where each
came from (see data/models/README.md). That key is stripped before transformers sees the config.

Nothing here imports transformers until a config must be built (`config_from_dict`, the Hub, the HF cache's
lookup); what the workload keeps of a config is `workload_loader`'s.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anatomist.config_fields import ESTIMATOR_FIELDS
from anatomist.errors import InputError
from anatomist.model_catalog import METADATA_KEY, catalog_entries, close_names, resolve


def catalog_names() -> list[str]:
    """The models shipped as configs in anatomist/data/models (`anatomist models`)."""
    return list(catalog_entries())


@dataclass(frozen=True, slots=True)
class FoundConfig:
    """A config.json found for MODEL: its content, where it is, and a config already built from it."""

    data: dict[str, Any]
    where: str
    """What messages name: a file, "catalog entry NAME", a Hub id."""
    source: str
    code_folder: str | None = None
    built: Any = None
    hub_id: str | None = None
    """The Hub repo the catalog resolved MODEL to."""
    note: str | None = None
    """Which catalog config stands in for MODEL, where an alias resolved it."""


def find_config(model: str, *, trust_remote_code: bool, allow_network: bool) -> FoundConfig:
    """MODEL's config.json: a path, a catalog entry, the local HF cache, or (allowed) the Hub."""
    path = Path(model).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        return FoundConfig(_read_json(file, path), str(file), "local", code_folder=str(file.parent))
    match = resolve(model)
    if match is not None:
        own = _in_hf_cache(match.hub_id) if match.alias else None  # an alias's own file beats a stand-in
        if own is not None:
            return FoundConfig(_read_json(own, own), match.hub_id, "hf-cache", code_folder=str(own.parent),
                          hub_id=match.hub_id)
        where = f"catalog entry {match.entry.name}"
        return FoundConfig(checked_config(dict(match.entry.config), where), where, "catalog", hub_id=match.hub_id,
                      note=match.note(model))
    cached = _in_hf_cache(model)
    if cached is not None:
        return FoundConfig(_read_json(cached, cached), model, "hf-cache", code_folder=str(cached.parent))
    if allow_network:
        return _from_hub(model, trust_remote_code)
    close = close_names(model)
    hint = (f"; did you mean {', '.join(close)}? (all: `anatomist models`)" if close
            else "; `anatomist models` lists the catalog")
    where = "the Hub" if allow_network else "the local HF cache (pass --allow-network to ask the Hub)"
    raise InputError(f"unknown model {model!r}: not a path, not in the catalog, not in {where}{hint}")


def _read_json(file: Path, given: Path) -> dict[str, Any]:
    if not file.is_file():
        raise InputError(f"{given}: no config.json there")
    text = file.read_text()
    if not text.strip():
        raise InputError(f"model config {str(file)!r} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise InputError(f"{file}: a config.json must hold a JSON object")
    return checked_config(data, str(file))


def checked_config(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` without the catalog's own key, refused where it lacks model_type or has a non-positive size
    (checked on the JSON alone: said before anything imports transformers)."""
    data = {k: v for k, v in data.items() if k != METADATA_KEY}
    if not data.get("model_type"):
        raise InputError(f"{where}: field model_type is missing; it names the architecture (e.g. \"bert\", \"llama\")")
    for name in ESTIMATOR_FIELDS:
        _positive(data.get(name), name, where)
    return data


def config_from_dict(data: dict[str, Any], where: str, trust_remote_code: bool, *,
                     code_folder: str | None = None) -> Any:
    """Build the transformers config a config.json describes, refusing what would break the estimate.

    Refuses only what the estimate cannot work with: an architecture transformers does not know
    (naming its model_type), one that needs remote code without `trust_remote_code`, a config
    transformers itself rejects, and a non-positive layer count, hidden size, head count or
    vocabulary size (ESTIMATOR_FIELDS, named as the config spells them). Every other field is
    transformers' business: a config it builds is never refused here (ALBERT's gap_size of 0,
    DeBERTa-v3's type_vocab_size of 0 and max_relative_positions of -1 are what those models use).

    Args:
        data: config.json's content; the catalog's own key (METADATA_KEY) is dropped.
        where: what to name in messages (a file path, "catalog entry NAME").
        trust_remote_code: whether a config whose model_type only remote code defines may be
            built (from `code_folder`, which must hold that code).

    Raises:
        InputError: one line naming the field and the value.
    """
    from transformers import CONFIG_MAPPING

    data = checked_config(data, where)
    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        if "auto_map" in data:
            if not trust_remote_code:
                raise InputError(f"{where}: model_type={model_type!r} needs the model's own code (auto_map); "
                                 "rerun with --trust-remote-code if you trust it")
            return _check_built(_remote_config(where, code_folder or str(Path(where).parent)), where)
        raise InputError(_unknown_architecture(where, str(model_type), CONFIG_MAPPING))
    config_cls = CONFIG_MAPPING[model_type]
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    for name in ESTIMATOR_FIELDS:
        _positive(data.get(aliases.get(name, name)), aliases.get(name, name), where)
    try:
        # A deep copy: transformers writes into the nested dicts it is given (rope_parameters gains rope_theta),
        # and `data` is what the workload's trace key is made of.
        config = config_cls.from_dict(copy.deepcopy({k: v for k, v in data.items() if k != "model_type"}))
    except Exception as exc:  # transformers raises TypeError, ValueError or huggingface_hub's StrictDataclassError
        if not isinstance(exc, (TypeError, ValueError)) and type(exc).__name__ not in _CONFIG_ERRORS:
            raise
        raise InputError(f"{where}: invalid config: {_one_line(exc)}") from None
    return _check_built(config, where)


# huggingface_hub's @strict validation errors (transformers 5 configs are strict dataclasses)
_CONFIG_ERRORS = ("StrictDataclassError", "StrictDataclassFieldValidationError", "StrictDataclassDefinitionError")


def _positive(value: Any, spelled: str, where: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise InputError(f"{where}: field {spelled} must be a positive integer, got {value!r}")


def _check_built(config: Any, where: str) -> Any:
    """Refuse a non-positive ESTIMATOR_FIELDS value of a built config: the text model's (a
    vision-language model keeps them in text_config), and an encoder-decoder's decoder depth."""
    text = config.get_text_config()
    mapping = getattr(text, "attribute_map", {}) or {}
    names = list(ESTIMATOR_FIELDS) + (["num_decoder_layers"] if getattr(config, "is_encoder_decoder", False) else [])
    for name in names:
        _positive(getattr(text, name, None), mapping.get(name, name), where)
    return config


def _remote_config(where: str, folder: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=True, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        raise InputError(f"{where}: cannot load its remote config code from {folder}: {_one_line(exc)}") from None


def _unknown_architecture(where: str, model_type: str, known: Any) -> str:
    import transformers

    close = difflib.get_close_matches(model_type, list(known.keys()), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; a newer transformers may know it"
    return f"{where}: unknown architecture model_type={model_type!r} (transformers {transformers.__version__}){hint}"


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _from_hub(model: str, trust_remote_code: bool) -> FoundConfig:
    """Ask the Hub for MODEL's config (allowed by the caller): transformers' AutoConfig, as users load it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError:
        raise InputError(f"unknown model {model!r}: the Hub has no config.json for it (or cannot be reached)") from None
    except ValueError as exc:
        message = str(exc).splitlines()[0]
        if "trust_remote_code" in message:
            raise InputError(f"{model}: needs remote code; rerun with --trust-remote-code if you trust it") from None
        raise InputError(f"{model}: invalid config: {message}") from None
    return FoundConfig(config.to_dict(), model, "hub", built=_check_built(config, model))


def _in_hf_cache(model: str) -> Path | None:
    """The config.json the local Hugging Face cache holds for the repo id `model`, if any (huggingface_hub's
    own lookup, the one transformers makes with local_files_only)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        found = try_to_load_from_cache(model, "config.json")
    except HFValidationError:  # not a repo id
        return None
    return Path(found) if isinstance(found, str) else None
