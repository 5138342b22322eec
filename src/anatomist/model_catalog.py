"""The shipped model catalog: Hub configs (no weights) with their Hub id and published size.

Each entry is `anatomist/data/models/NAME.json`: the model's config.json as the Hub has it, plus
one key, `"_anatomist"` (see data/models/README.md), that says which Hub repo it is, how many
parameters its authors publish and where both came from. `anatomist models` lists the entries;
tests/test_catalog.py builds each one on the meta device and checks the count against the
published figure, which catches a mistyped field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from anatomist.config_fields import LAYER_FIELDS, context_length, experts_of

METADATA_KEY = "_anatomist"
"""The catalog's own key in a config file; stripped before transformers sees the config."""

DEFAULT_TOLERANCE = 0.005
"""Built vs published parameter count, relative: 0.5% unless an entry says otherwise."""

# Leading organisation prefixes that also name a catalog entry (older Hub ids, lower case).
_HUB_PREFIXES = ("google-bert/", "openai-community/", "google-t5/", "meta-llama/", "qwen/", "mistralai/")


@dataclass(kw_only=True, slots=True, frozen=True)
class CatalogEntry:
    """One shipped config and what its authors publish about it."""

    name: str
    """File name without .json: what `anatomist estimate NAME` takes."""
    hub_id: str
    """The Hugging Face repo the config comes from, e.g. "Qwen/Qwen3-8B"."""
    parameters: int
    """The parameter count the test compares the built model with (tied weights counted once)."""
    parameters_source: str
    """Where `parameters` comes from, and what the model card itself says."""
    config_source: str
    """Where the config.json fields come from."""
    tolerance: float = DEFAULT_TOLERANCE
    """Allowed relative gap between the built and the published count."""
    note: str = ""
    """Anything a reader should know (text tower only, fields left out, ...)."""
    config: dict[str, Any]
    """The config.json fields, without the catalog's own key."""
    checkpoint_dtype: str | None = None
    """The dtype of the checkpoint's floating-point weights, where its config.json names none: what
    `from_pretrained(dtype="auto")` then loads (transformers reads it from the checkpoint's first floating tensor)."""
    checkpoint_dtype_source: str = ""
    """Where `checkpoint_dtype` comes from."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Fields the config.json leaves to transformers' config class, spelled out where `anatomist
    models` shows them (it reads the JSON without transformers; the catalog test checks each)."""

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    def config_field(self, name: str) -> Any:
        """A config field as transformers reads it: the JSON's, else the class default in `defaults`, else None."""
        return self.config.get(name, self.defaults.get(name))


@cache
def catalog_entries() -> dict[str, CatalogEntry]:
    """Every shipped entry by name, in name order (case aside).

    Raises:
        ValueError: a file without its `_anatomist` block or with a malformed one (a packaging
            bug, not user input: the catalog test fails first).
    """
    folder = resources.files("anatomist.data").joinpath("models")
    entries = {}
    for file in sorted(folder.iterdir(), key=lambda f: f.name.lower().removesuffix(".json")):
        if file.name.endswith(".json"):
            entry = _entry(file.name.removesuffix(".json"), json.loads(file.read_text()))
            entries[entry.name] = entry
    return entries


def find_entry(model: str) -> CatalogEntry | None:
    """The entry MODEL names: its file name or Hub id (any case), or a unique "-vX" completion."""
    entries = catalog_entries()
    lowered = model.lower()
    for entry in entries.values():
        if lowered in (entry.name.lower(), entry.hub_id.lower()):
            return entry
    for prefix in _HUB_PREFIXES:
        lowered = lowered.removeprefix(prefix)
    by_lower = {name.lower(): entry for name, entry in entries.items()}
    if lowered in by_lower:
        return by_lower[lowered]
    # "Mistral-7B" -> "Mistral-7B-v0.1", "Mixtral-8x7B" -> "Mixtral-8x7B-v0.1"
    completions = [entry for low, entry in by_lower.items() if low.startswith(lowered + "-v")]
    return completions[0] if len(completions) == 1 else None


def _entry(name: str, data: dict[str, Any]) -> CatalogEntry:
    meta = data.get(METADATA_KEY)
    if not isinstance(meta, dict):
        raise ValueError(f"catalog entry {name}: no {METADATA_KEY!r} block (hub_id, parameters, sources)")
    config = {k: v for k, v in data.items() if k != METADATA_KEY}
    try:
        return CatalogEntry(
            name=name, hub_id=meta["hub_id"], parameters=int(meta["parameters"]),
            parameters_source=meta["parameters_source"], config_source=meta["config_source"],
            tolerance=float(meta.get("tolerance", DEFAULT_TOLERANCE)), note=meta.get("note", ""), config=config,
            defaults=dict(meta.get("defaults", {})), checkpoint_dtype=meta.get("checkpoint_dtype"),
            checkpoint_dtype_source=meta.get("checkpoint_dtype_source", ""),
        )
    except KeyError as exc:
        raise ValueError(f"catalog entry {name}: {METADATA_KEY} lacks {exc.args[0]!r}") from None


@dataclass(kw_only=True, slots=True)
class ModelSummary:
    """What `anatomist models` shows for one entry."""

    name: str
    hub_id: str
    family: str
    """transformers' model_type: the architecture the entry builds."""
    parameters: int
    """Published count (the catalog test keeps the built model within `tolerance` of it)."""
    layers: int
    """Transformer blocks: the encoder's for an encoder-decoder model."""
    decoder_layers: int | None
    """Decoder blocks of an encoder-decoder model (they may differ from the encoder's), else None."""
    context_length: int | None
    """Longest sequence the config allows, None where it sets no limit."""
    experts: int | None
    """Routed experts per MoE layer, None for a dense model."""
    experts_per_token: int | None

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__} | {"moe": self.is_moe}


def summarize(entry: CatalogEntry) -> ModelSummary:
    """Family, size, depth, context length and experts of an entry, read from its config.json fields
    alone (`anatomist models` imports neither transformers nor torch; tests/test_catalog.py checks
    every entry against the config transformers builds)."""
    field = entry.config_field
    layers = next(int(field(name)) for name in LAYER_FIELDS if field(name) is not None)
    decoder_layers = int(field("num_decoder_layers") or layers) if field("is_encoder_decoder") else None
    moe = experts_of(field)
    return ModelSummary(
        name=entry.name, hub_id=entry.hub_id, family=entry.model_type, parameters=entry.parameters,
        layers=layers, decoder_layers=decoder_layers, context_length=context_length(field, entry.model_type),
        experts=moe[1] if moe else None, experts_per_token=moe[0] if moe else None,
    )
