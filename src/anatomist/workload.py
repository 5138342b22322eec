"""Workload: which model (config only, never weights), which task head, which inputs.

MODEL resolves, in this order, from a local directory or config.json, the shipped catalog
(`anatomist models`, by file name or Hub id, or through an alias: an instruct variant or re-upload whose config the
catalog entry stands in for, said in the estimate's notes), and the local Hugging Face cache. The network is
used only when the caller passes `allow_network=True`; remote model code runs only with
`trust_remote_code=True`.

The catalog is `anatomist/data/models/NAME.json`: the model's Hub config.json plus one key,
`"_anatomist"`, that names the Hub repo, the parameter count its authors publish and where each
came from (see data/models/README.md). That key is stripped before transformers sees the config.

A Workload holds the config.json as read (`config_json`: what the trace caches key on) and what
the estimator reads of it (`facts`, `model_facts.ModelFacts`). The transformers config (`config`)
is built only when something needs it (building a model to trace): the facts of a config.json
already seen with this transformers are kept with the traces, so a repeated estimate imports
neither transformers nor torch.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from anatomist.config_fields import ESTIMATOR_FIELDS, LAYER_FIELDS
from anatomist.errors import InputError
from anatomist.model_catalog import METADATA_KEY, catalog_entries, close_names, resolve
from anatomist.model_facts import TASKS, ModelFacts
from anatomist.token_stats import TokenStats, read_lengths, stats_from_mean

__all__ = ["LAYER_FIELDS", "PEFT_TASK_TYPES", "TASKS", "Task", "Workload", "catalog_names", "config_from_dict",
           "load_workload", "workload_from_config"]

Task = Literal["sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm"]
PEFT_TASK_TYPES = {"sequence-classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}
"""peft.TaskType of each task (masked-lm has none: PEFT wraps it as a plain model)."""


@dataclass(kw_only=True, slots=True)
class Workload:
    """A model config plus the shape of one training sample."""

    name: str
    """Catalog name, Hub id or path the user gave."""
    config_json: dict[str, Any]
    """The config.json as read (the catalog's own key dropped): what the trace caches key on."""
    facts: ModelFacts
    """What the estimator reads of the config (`model_facts`)."""
    task: Task
    """Which head is trained: the seeds' experiment is sequence classification."""
    seq_len: int
    """Tokens per sample."""
    source: str = "catalog"
    """Where the config came from: catalog, local, hf-cache, hub, or live (a loaded model's, `workload_from_config`)."""
    trust_remote_code: bool = False
    num_labels: int = 2
    extra: dict[str, Any] = field(default_factory=dict)
    code_folder: str | None = None
    """Where a config that needs the model's own code (auto_map) finds it."""
    built_config: Any = field(default=None, repr=False, compare=False)
    """The transformers config, once built (`config`)."""
    tokens: TokenStats | None = None
    """The data's token statistics (--avg-seq-len, --lengths): what padding-free training processes."""
    prompt_len: int = 0
    """Tokens of each sequence's prompt, which a preference loss does not score (--prompt-len; DPO)."""
    hub_id: str | None = None
    """The Hub repo MODEL means, where the catalog resolved it (an alias's own id, not the entry's); else None."""
    config_note: str | None = None
    """Which config stands in for MODEL when it is not the repo's own (a catalog alias), for the notes; else None."""
    _trace_key: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def config(self) -> Any:
        """The transformers.PretrainedConfig of `config_json` (built on first use: imports transformers)."""
        if self.built_config is None:
            self.built_config = config_from_dict(self.config_json, self.name, self.trust_remote_code,
                                                 code_folder=self.code_folder)
        return self.built_config

    @property
    def model_type(self) -> str:
        return self.facts.model_type

    @property
    def repo_id(self) -> str:
        """What `from_pretrained` takes: the Hub repo the catalog resolved MODEL to, else the name given."""
        return self.hub_id or self.name

    def trace_key(self) -> tuple[Any, ...]:
        """What decides the model a trace builds and the inputs it feeds: the caches' key (the
        config.json's content, canonically written, not transformers' object: no import needed)."""
        if self._trace_key is None:
            prompt = (self.prompt_len,) if self.prompt_len else ()  # DPO scores the completion only
            self._trace_key = (canonical_json(self.config_json), self.task, self.num_labels, self.seq_len, *prompt)
        return self._trace_key

    def for_recipe(self, recipe: Any) -> Workload:
        """The samples `recipe` trains on: padding-free (not packed) micro-batches are the data's sequences at their
        mean length (`tokens`); packed rows and padded micro-batches are `seq_len` tokens each.

        Raises:
            InputError: padding-free training without the data's lengths.
        """
        if not recipe.padding_free or recipe.packing:
            return self
        if self.tokens is None:
            raise InputError("padding_free: a micro-batch holds the data's sequences without padding; give their "
                             "lengths: --avg-seq-len N or --lengths FILE")
        return dataclasses.replace(self, seq_len=self.tokens.avg_seq_len)

    @property
    def is_moe(self) -> bool:
        return self.facts.experts is not None

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the config's position embeddings allow, None where nothing limits it."""
        return self.facts.max_positions

    @property
    def config_dtype(self) -> str:
        """What `from_pretrained(dtype="auto")` loads the weights in: the dtype the config names, else the
        checkpoint's where the catalog records it (transformers reads the checkpoint's first floating tensor),
        else float32."""
        named = any(self.config_json.get(key) is not None for key in ("dtype", "torch_dtype"))
        match = resolve(self.name) if self.source == "catalog" and not named else None
        entry = match.entry if match is not None else None
        if entry is not None and entry.checkpoint_dtype is not None:
            return entry.checkpoint_dtype
        return self.facts.config_dtype

    def default_attention(self) -> str:
        """The attention transformers builds this model's task with where none is asked for: SDPA, or eager where
        the class has no SDPA (`model_facts.ModelFacts.eager_tasks`)."""
        return "eager" if self.task in self.facts.eager_tasks else "sdpa"

    def lora_default_targets(self) -> tuple[str, ...] | None:
        """The modules PEFT's LoraConfig targets in this model when none are named, None where PEFT has no default
        for it (`trace.step.peft_defaults`, asked once per config, task and peft version: the trace cache)."""
        from anatomist.model_facts import LoraDefaults
        from anatomist.trace.store import cache

        def ask_peft() -> LoraDefaults:
            from anatomist.trace.step.peft_defaults import default_targets

            return LoraDefaults(targets=default_targets(self, PEFT_TASK_TYPES.get(self.task)))

        key = ("lora-defaults", canonical_json(self.config_json), self.task, self.num_labels, self.trust_remote_code)
        return cache.get_or_trace(key, ask_peft, LoraDefaults).targets

    def hidden_size(self) -> int:
        """The model's hidden size as transformers' `HfTrainerDeepSpeedConfig.trainer_config_finalize` finds it
        to fill DeepSpeed's "auto" buffer sizes: `hidden_size`, else the largest of `hidden_sizes`, else the
        same in `text_config` (GPT-2's `n_embd` is `hidden_size` through its attribute map).

        Raises:
            InputError: a config with neither (the Trainer refuses "auto" there too).
        """
        for config in (self.config, getattr(self.config, "text_config", None)):
            if config is None:
                continue
            if getattr(config, "hidden_size", None):
                return int(config.hidden_size)
            if getattr(config, "hidden_sizes", None):
                return int(max(config.hidden_sizes))
        raise InputError(f"{self.name}: its config has neither hidden_size nor hidden_sizes, from which the Trainer "
                         "fills DeepSpeed's auto bucket sizes; set --reduce-bucket-size, --stage3-prefetch-bucket-size "
                         "and --stage3-param-persistence-threshold")

    def weights_dtype(self, requested: str) -> str:
        """The dtype the weights load in for `requested` ("auto": the checkpoint's, `config_dtype`)."""
        return self.config_dtype if requested == "auto" else requested

    def build_model(self, attn_implementation: str = "sdpa", dtype: str = "auto",
                    experts_implementation: str | None = None, config: Any = None) -> Any:
        """Instantiate the task model from the config (random init, no weights loaded) with its
        weights in `dtype` (`from_pretrained`'s meaning; "auto" is the config's dtype) and, where
        given, the Mixture-of-Experts kernel `experts_implementation` (else transformers' choice).
        `config`: another config of the same model to build instead (a cut of it, `trace.depth.configs`)."""
        import torch
        import transformers

        auto = {
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "causal-lm": transformers.AutoModelForCausalLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
            "masked-lm": transformers.AutoModelForMaskedLM,
        }[self.task]
        # A copy: from_config writes the dtype into the config it is given, and the workload's
        # config must stay as loaded (it says what "auto" means).
        config = copy.deepcopy(self.config if config is None else config)
        if self.task == "sequence-classification":
            config.num_labels = self.num_labels
            if getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = 0  # decoder classifiers need one to find the last token
        torch_dtype = getattr(torch, self.weights_dtype(dtype))
        experts = {"experts_implementation": experts_implementation} if experts_implementation else {}
        try:
            return auto.from_config(
                config, attn_implementation=attn_implementation, trust_remote_code=self.trust_remote_code,
                dtype=torch_dtype, **experts,
            )
        except ValueError as exc:
            first = str(exc).splitlines()[0]
            raise InputError(f"{self.name}: cannot build a {self.task} model: {first}") from None


def canonical_json(data: dict[str, Any]) -> str:
    """`data` written one way only (sorted keys): two equal configs, one key."""
    return json.dumps(data, sort_keys=True, default=str)


def catalog_names() -> list[str]:
    """The models shipped as configs in anatomist/data/models (`anatomist models`)."""
    return list(catalog_entries())


@dataclass(frozen=True, slots=True)
class _Found:
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


def load_workload(
    model: str,
    *,
    seq_len: int | None = None,
    task: Task | None = None,
    trust_remote_code: bool = False,
    allow_network: bool = False,
    avg_seq_len: int | None = None,
    lengths: str | None = None,
    prompt_len: int | None = None,
) -> Workload:
    """Resolve MODEL to a Workload; `avg_seq_len` or `lengths` (a file of token counts): the data's token
    statistics (`token_stats`), read against the maximum length `seq_len`.

    Raises:
        InputError: unknown model (with close names), malformed config (naming the field),
            seq_len out of range, remote code without `trust_remote_code`, both or bad token statistics.
    """
    found = _find_config(model, trust_remote_code=trust_remote_code, allow_network=allow_network)
    workload = _workload(model, found, seq_len=seq_len, task=task, trust_remote_code=trust_remote_code)
    if avg_seq_len is not None and lengths is not None:
        raise InputError("--avg-seq-len and --lengths both give the data's lengths: give one")
    if avg_seq_len is not None:
        workload.tokens = stats_from_mean(avg_seq_len, workload.seq_len)
    elif lengths is not None:
        workload.tokens = read_lengths(lengths, workload.seq_len)
    if prompt_len is not None:
        if not 0 <= prompt_len < workload.seq_len:
            raise InputError(f"--prompt-len must be at least 0 and below the sequence length {workload.seq_len}, "
                             f"got {prompt_len}")
        workload.prompt_len = prompt_len
    return workload


LIVE_ONLY_KEYS = ("quantization_config", "_name_or_path", "transformers_version")
"""Keys a loaded model's config carries that say how it was loaded, not what it is: the recipe says
the quantization (a Workload is the architecture), and where and with which release it was loaded
changes no trace."""


def workload_from_config(config: Any, *, name: str, task: Task, seq_len: int, num_labels: int = 2,
                         trust_remote_code: bool = False) -> Workload:
    """The Workload of a live model's transformers config (`model.config`), without writing a file.

    Args:
        config: a `transformers.PretrainedConfig` (its `to_dict()` is read, less LIVE_ONLY_KEYS).
        name: what messages call the model (its `_name_or_path`).
        task, seq_len, num_labels: as `load_workload` takes them.

    Raises:
        InputError: as `load_workload` (an architecture transformers does not know, remote code
            without `trust_remote_code`, seq_len out of range).
    """
    data = {k: v for k, v in config.to_dict().items() if k not in LIVE_ONLY_KEYS}
    workload = _workload(name, _Found(_checked(data, name), name, "live"), seq_len=seq_len, task=task,
                         trust_remote_code=trust_remote_code)
    workload.num_labels = num_labels
    return workload


def _workload(model: str, found: _Found, *, seq_len: int | None, task: Task | None,
              trust_remote_code: bool) -> Workload:
    facts, built = _facts(found, trust_remote_code)
    chosen_task: Task = task or facts.default_task  # type: ignore[assignment]
    if chosen_task not in TASKS:
        raise InputError(f"unknown task {chosen_task!r}; known: {', '.join(TASKS)}")
    limit = facts.max_positions
    if seq_len is None:
        seq_len = min(512, limit) if limit else 512
    if seq_len <= 0:
        raise InputError(f"seq_len must be greater than 0, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise InputError(f"seq_len {seq_len} is above {model}'s maximum of {limit} positions")
    return Workload(name=model, config_json=found.data, facts=facts, task=chosen_task, seq_len=seq_len,
                    source=found.source, trust_remote_code=trust_remote_code, code_folder=found.code_folder,
                    built_config=built, hub_id=found.hub_id, config_note=found.note)


def _facts(found: _Found, trust_remote_code: bool) -> tuple[ModelFacts, Any]:
    """The facts of `found`'s config and the transformers config if it had to be built for them: from the
    trace cache where this config.json was read before with this transformers (no import), else read."""
    from anatomist.model_facts import facts_of
    from anatomist.trace.store import cache

    built: list[Any] = [found.built]

    def read() -> ModelFacts:
        if built[0] is None:
            built[0] = config_from_dict(found.data, found.where, trust_remote_code, code_folder=found.code_folder)
        return facts_of(built[0])

    facts = cache.get_or_trace(("model-facts", canonical_json(found.data), trust_remote_code), read, ModelFacts)
    return facts, built[0]


def _find_config(model: str, *, trust_remote_code: bool, allow_network: bool) -> _Found:
    """MODEL's config.json: a path, a catalog entry, the local HF cache, or (allowed) the Hub."""
    path = Path(model).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        return _Found(_read_json(file, path), str(file), "local", code_folder=str(file.parent))
    match = resolve(model)
    if match is not None:
        own = _in_hf_cache(match.hub_id) if match.alias else None  # an alias's own file beats a stand-in
        if own is not None:
            return _Found(_read_json(own, own), match.hub_id, "hf-cache", code_folder=str(own.parent),
                          hub_id=match.hub_id)
        where = f"catalog entry {match.entry.name}"
        return _Found(_checked(dict(match.entry.config), where), where, "catalog", hub_id=match.hub_id,
                      note=match.note(model))
    cached = _in_hf_cache(model)
    if cached is not None:
        return _Found(_read_json(cached, cached), model, "hf-cache", code_folder=str(cached.parent))
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
    return _checked(data, str(file))


def _checked(data: dict[str, Any], where: str) -> dict[str, Any]:
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

    data = _checked(data, where)
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
        config = config_cls.from_dict({k: v for k, v in data.items() if k != "model_type"})
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


def _from_hub(model: str, trust_remote_code: bool) -> _Found:
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
    return _Found(config.to_dict(), model, "hub", built=_check_built(config, model))


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
