"""The shipped model catalog: Hub configs (no weights) with their Hub id and published size.

Each entry is `anatomist/data/models/NAME.json`: the model's config.json as the Hub has it, plus
one key, `"_anatomist"` (see data/models/README.md), that says which Hub repo it is, how many
parameters its authors publish and where both came from. `anatomist models` lists the entries;
tests/test_catalog.py builds each one on the meta device and checks the count against the
published figure, which catches a mistyped field.

A name people type may be another repo with the same architecture and sizes (an instruct variant, a re-upload): the
alias table `anatomist/data/model_aliases.toml` maps such Hub ids to an entry, with the source of each and what its
own config.json sets otherwise. `resolve` finds the entry (or alias) a name means, and says when a name means
several.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal, get_args

from anatomist.config_fields import LAYER_FIELDS, context_length, experts_of
from anatomist.errors import InputError

METADATA_KEY = "_anatomist"
"""The catalog's own key in a config file; stripped before transformers sees the config."""

DEFAULT_TOLERANCE = 0.005
"""Built vs published parameter count, relative: 0.5% unless an entry says otherwise."""

AliasKind = Literal["instruct", "base", "fine-tune", "re-upload", "checkpoints"]


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


@dataclass(kw_only=True, slots=True, frozen=True)
class CatalogAlias:
    """A Hub repo that resolves to a catalog entry's config (data/model_aliases.toml)."""

    hub_id: str
    """Its Hugging Face repo, e.g. "meta-llama/Llama-3.1-8B-Instruct"."""
    config: str
    """The catalog entry whose config.json stands in for its own."""
    kind: AliasKind
    """What it is to the entry: instruct, base, fine-tune, re-upload or checkpoints."""
    source: str
    """Where its own config.json was read, or why it was not."""
    differs: dict[str, Any] | None
    """The fields its config.json sets to other values than the entry's (its values); {} when none does, None when
    its config.json was not compared."""

    @property
    def name(self) -> str:
        """The repo's name without its organisation: what `anatomist estimate NAME` also takes."""
        return self.hub_id.split("/", 1)[1]


@dataclass(kw_only=True, slots=True, frozen=True)
class CatalogMatch:
    """The catalog config a model name resolves to: an entry, by its own name or through an alias."""

    entry: CatalogEntry
    alias: CatalogAlias | None = None
    """The alias the name went through; None when it names the entry itself."""

    @property
    def hub_id(self) -> str:
        """The repo the name means (what `from_pretrained` takes): the alias's, else the entry's."""
        return self.alias.hub_id if self.alias else self.entry.hub_id

    def note(self, given: str) -> str | None:
        """What the estimate says of the config used for `given` when it is not the repo's own, else None."""
        if self.alias is None:
            return None
        alias, entry = self.alias, self.entry
        used = f"{given}: the config of catalog entry {entry.name} ({entry.hub_id}) stands in for {alias.hub_id}"
        if alias.differs is None:
            return (f"{used} ({alias.kind}: {alias.source}); anything its own config.json sets otherwise is not "
                    "modelled (give the path of its config.json to use it)")
        if not alias.differs:
            return f"{used} ({alias.kind}), whose config.json sets the same architecture and sizes"
        fields = ", ".join(f"{name}={value!r}" for name, value in alias.differs.items())
        return (f"{used} ({alias.kind}), whose config.json differs only in {fields}: "
                "nothing that changes memory or time")


def catalog_aliases() -> dict[str, CatalogAlias]:
    """Every alias by Hub id, in the table's order (data/model_aliases.toml).

    Raises:
        ValueError: a malformed row or one naming no catalog entry (a packaging bug: the catalog test fails first).
    """
    return dict(_aliases())


@cache
def _aliases() -> tuple[tuple[str, CatalogAlias], ...]:
    table = tomllib.loads(resources.files("anatomist.data").joinpath("model_aliases.toml").read_text())
    entries = catalog_entries()
    out = []
    for hub_id, row in table["aliases"].items():
        if "/" not in hub_id or row.get("config") not in entries or row.get("kind") not in get_args(AliasKind):
            raise ValueError(f"model alias {hub_id}: needs an ORG/NAME id, a catalog config and a kind, got {row}")
        out.append((hub_id, CatalogAlias(hub_id=hub_id, config=row["config"], kind=row["kind"], source=row["source"],
                                         differs=row.get("differs"))))
    return tuple(out)


def find_entry(model: str) -> CatalogEntry | None:
    """The entry MODEL resolves to (`resolve`), else None."""
    match = resolve(model)
    return match.entry if match else None


def resolve(model: str) -> CatalogMatch | None:
    """The catalog config MODEL names, else None.

    MODEL is, in any case: an entry's file name or Hub id; an alias's Hub id; the repo name of either without its
    organisation ("Llama-3.1-8B-Instruct"); ORG/NAME where ORG is the repo's own organisation; or any of these less a
    "-vX" ending ("Mixtral-8x7B" -> Mixtral-8x7B-v0.1). Another organisation's repo of the same name is not assumed
    to be the same model: it resolves only if the alias table lists its Hub id.

    Raises:
        InputError: MODEL names several catalog configs (a name without its version, an organisation's repo name
            that two entries share).
    """
    lowered = model.lower()
    org, _, name = lowered.rpartition("/")
    records = _name_records()
    for exact in (True, False):
        found = [match for record_org, record_name, match in records
                 if (not org or org == record_org)
                 and (record_name == name if exact else record_name.startswith(name + "-v"))]
        if found:
            return _one(model, found)
    return None


def close_names(model: str, n: int = 3) -> list[str]:
    """The catalog names and aliases closest to MODEL, for a hint: Hub ids where MODEL gives an organisation, else
    the names without one."""
    pairs = [(e.hub_id, e.name) for e in catalog_entries().values()]
    pairs += [(a.hub_id, a.name) for a in catalog_aliases().values()]
    names = {shown.lower(): shown for shown in (hub_id if "/" in model else name for hub_id, name in pairs)}
    return [names[c] for c in difflib.get_close_matches(model.lower(), list(names), n=n, cutoff=0.4)]


def _one(model: str, found: list[CatalogMatch]) -> CatalogMatch:
    """The one config among `found`; the entry itself before an alias to it, the table's first alias before later ones.

    Raises:
        InputError: `found` holds several configs.
    """
    configs = {match.entry.name: match for match in reversed(found)}
    if len(configs) > 1:
        named = ", ".join(f"{m.entry.name} ({m.hub_id})" for m in sorted(configs.values(), key=lambda m: m.entry.name))
        raise InputError(f"{model!r} names several catalog models: {named}; give one of them")
    return next((m for m in found if m.alias is None), found[0])


@cache
def _name_records() -> tuple[tuple[str | None, str, CatalogMatch], ...]:
    """(organisation or None, lower-case name, match) for every way a name reaches a config: an entry's file name
    (no organisation) and Hub id, an alias's Hub id."""
    records: list[tuple[str | None, str, CatalogMatch]] = []
    for entry in catalog_entries().values():
        org, _, repo = entry.hub_id.lower().rpartition("/")
        records += [(None, entry.name.lower(), CatalogMatch(entry=entry)), (org, repo, CatalogMatch(entry=entry))]
    for alias in catalog_aliases().values():
        org, _, repo = alias.hub_id.lower().rpartition("/")
        records.append((org, repo, CatalogMatch(entry=catalog_entries()[alias.config], alias=alias)))
    return tuple(records)


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
    aliases: tuple[str, ...] = ()
    """Hub ids of the aliases this entry's config stands in for (data/model_aliases.toml)."""

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
        aliases=tuple(alias.hub_id for alias in catalog_aliases().values() if alias.config == entry.name),
    )
