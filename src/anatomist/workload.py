"""Workload: which model (config only, never weights), which task head, which inputs.

MODEL resolves, in this order, from a local directory or config.json, the shipped catalog
(`anatomist models`, by file name or Hub id), and the local Hugging Face cache. The network is
used only when the caller passes `allow_network=True`; remote model code runs only with
`trust_remote_code=True`.

The catalog is `anatomist/data/models/NAME.json`: the model's Hub config.json plus one key,
`"_anatomist"`, that names the Hub repo, the parameter count its authors publish and where each
came from (see data/models/README.md). That key is stripped before transformers sees the config.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from anatomist.errors import InputError
from anatomist.model_catalog import METADATA_KEY, catalog_entries, find_entry

Task = Literal["sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm"]
TASKS: tuple[str, ...] = ("sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm")
PEFT_TASK_TYPES = {"sequence-classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}
"""peft.TaskType of each task (masked-lm has none: PEFT wraps it as a plain model)."""

# The sizes the estimator builds from: each must be a positive integer where the config has it.
# Canonical transformers names; a config class may store them under its own (GPT-2's n_layer).
ESTIMATOR_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")

LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
"""The names a config.json gives its (encoder's) block count: GPT-2's and T5's are aliases in
transformers' `attribute_map`."""

# Encoders that transformers also gives a causal-LM class (BertLMHeadModel, ...): still encoders.
_ENCODER_TYPES = ("bert", "roberta", "deberta", "deberta-v2", "distilbert", "albert", "electra")

# Models whose position ids start after the padding index (RobertaEmbeddings'
# create_position_ids_from_input_ids), so max_position_embeddings - pad_token_id - 1 tokens fit.
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod")


@dataclass(kw_only=True, slots=True)
class Workload:
    """A model config plus the shape of one training sample."""

    name: str
    """Catalog name, Hub id or path the user gave."""
    config: Any
    """A transformers.PretrainedConfig."""
    task: Task
    """Which head is trained: the seeds' experiment is sequence classification."""
    seq_len: int
    """Tokens per sample."""
    source: str = "catalog"
    """Where the config came from: catalog, local, hf-cache or hub."""
    trust_remote_code: bool = False
    num_labels: int = 2
    extra: dict[str, Any] = field(default_factory=dict)
    _trace_key: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _is_moe: bool | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    @property
    def repo_id(self) -> str:
        """What `from_pretrained` takes: the catalog entry's Hub repo, else the name given."""
        entry = find_entry(self.name) if self.source == "catalog" else None
        return entry.hub_id if entry else self.name

    def trace_key(self) -> tuple[Any, ...]:
        """What decides the model a trace builds and the inputs it feeds: the caches' key.

        Computed once (a JSON dump of the config): nothing changes a workload's config after
        loading; `model_at_depth` and `dataclasses.replace` make new workloads."""
        if self._trace_key is None:
            self._trace_key = (self.config.to_json_string(use_diff=False), self.task, self.num_labels, self.seq_len)
        return self._trace_key

    @property
    def is_moe(self) -> bool:
        """Computed once, like `trace_key` (a plan asks for every recipe: the config's attribute
        lookups are slow)."""
        if self._is_moe is None:
            self._is_moe = moe_counts(self.config) is not None
        return self._is_moe

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the config's position embeddings allow, None where nothing limits it."""
        text = self.config.get_text_config()
        return context_length(lambda name: getattr(text, name, None), self.model_type)

    @property
    def config_dtype(self) -> str:
        """The dtype the config names, else float32: what `from_pretrained(dtype="auto")` loads the weights
        in. (A config.json's older `torch_dtype` is read into `dtype` by transformers >= 5, whose
        `torch_dtype` attribute only repeats it with a deprecation warning.)"""
        value = getattr(self.config, "dtype", None)
        name = str(value).removeprefix("torch.") if value is not None else "float32"
        return name if name in ("float32", "bfloat16", "float16") else "float32"

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
        """The dtype the weights load in for `requested` ("auto": the config's).

        Raises:
            InputError: a dtype this model's code rejects (Mixture-of-Experts layers run their
                experts through `grouped_mm`, which takes bf16 only).
        """
        dtype = self.config_dtype if requested == "auto" else requested
        if self.is_moe and dtype != "bfloat16":
            raise InputError(
                f"{self.name}: its Mixture-of-Experts layers run grouped_mm, which takes bfloat16 weights only; "
                f"--dtype {requested} would load them in {dtype}: use --dtype bfloat16"
            )
        return dtype

    def build_model(self, attn_implementation: str = "sdpa", dtype: str = "auto",
                    experts_implementation: str | None = None, config: Any = None) -> Any:
        """Instantiate the task model from the config (random init, no weights loaded) with its
        weights in `dtype` (`from_pretrained`'s meaning; "auto" is the config's dtype) and, where
        given, the Mixture-of-Experts kernel `experts_implementation` (else transformers' choice).
        `config`: another config of the same model to build instead (a cut of it, `trace.cutting`)."""
        import torch
        import transformers

        auto = {
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "causal-lm": transformers.AutoModelForCausalLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
            "masked-lm": transformers.AutoModelForMaskedLM,
        }[self.task]
        # A copy: from_config writes the dtype into the config it is given, and the workload's
        # config must stay as loaded (it is the trace caches' key and says what "auto" means).
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


def catalog_names() -> list[str]:
    """The models shipped as configs in anatomist/data/models (`anatomist models`)."""
    return list(catalog_entries())


def load_workload(
    model: str,
    *,
    seq_len: int | None = None,
    task: Task | None = None,
    trust_remote_code: bool = False,
    allow_network: bool = False,
) -> Workload:
    """Resolve MODEL to a Workload.

    Raises:
        InputError: unknown model (with close names), malformed config (naming the field),
            seq_len out of range, remote code without `trust_remote_code`.
    """
    config, source = _resolve_config(model, trust_remote_code=trust_remote_code, allow_network=allow_network)
    chosen_task: Task = task or _default_task(config)
    if chosen_task not in TASKS:
        raise InputError(f"unknown task {chosen_task!r}; known: {', '.join(TASKS)}")
    workload = Workload(name=model, config=config, task=chosen_task, seq_len=512, source=source,
                        trust_remote_code=trust_remote_code)
    limit = workload.max_positions
    if seq_len is None:
        seq_len = min(512, limit) if limit else 512
    if seq_len <= 0:
        raise InputError(f"seq_len must be greater than 0, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise InputError(f"seq_len {seq_len} is above {model}'s maximum of {limit} positions")
    workload.seq_len = seq_len
    return workload


def _default_task(config: Any) -> Task:
    """seq2seq-lm for encoder-decoders; sequence classification (the seeds' experiment) for encoders,
    known by model_type, by a masked-LM checkpoint, or by having no causal-LM class; else causal-lm."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    architectures = getattr(config, "architectures", None) or []
    if (config.model_type in _ENCODER_TYPES or any(a.endswith("ForMaskedLM") for a in architectures)
            or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING):
        return "sequence-classification"
    return "causal-lm"


def _resolve_config(model: str, *, trust_remote_code: bool, allow_network: bool) -> tuple[Any, str]:
    path = Path(model).expanduser()
    if path.exists():
        return _config_from_path(path, trust_remote_code), "local"
    entry = find_entry(model)
    if entry is not None:
        return config_from_dict(dict(entry.config), f"catalog entry {entry.name}", trust_remote_code), "catalog"
    hub_config = _config_from_hub(model, trust_remote_code=trust_remote_code, allow_network=allow_network)
    if hub_config is not None:
        return hub_config
    close = difflib.get_close_matches(model.lower(), [n.lower() for n in catalog_names()], n=3, cutoff=0.4)
    names = {n.lower(): n for n in catalog_names()}
    hint = f"; did you mean {', '.join(names[c] for c in close)}?" if close else ""
    where = "the Hub" if allow_network else "the local HF cache (pass --allow-network to ask the Hub)"
    raise InputError(f"unknown model {model!r}: not a path, not in the catalog, not in {where}{hint}")


def _config_from_path(path: Path, trust_remote_code: bool) -> Any:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"{path}: no config.json there")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise InputError(f"{file}: a config.json must hold a JSON object")
    return config_from_dict(data, str(file), trust_remote_code)


def config_from_dict(data: dict[str, Any], where: str, trust_remote_code: bool) -> Any:
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
            built (from `where`'s folder, which must hold that code).

    Raises:
        InputError: one line naming the field and the value.
    """
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k != METADATA_KEY}
    model_type = data.get("model_type")
    if not model_type:
        raise InputError(f"{where}: field model_type is missing; it names the architecture (e.g. \"bert\", \"llama\")")
    if model_type not in CONFIG_MAPPING:
        if "auto_map" in data:
            if not trust_remote_code:
                raise InputError(f"{where}: model_type={model_type!r} needs the model's own code (auto_map); "
                                 "rerun with --trust-remote-code if you trust it")
            return _check_estimator_fields(_remote_config(where), where)
        raise InputError(_unknown_architecture(where, str(model_type), CONFIG_MAPPING))
    config_cls = CONFIG_MAPPING[model_type]
    _check_estimator_fields(data, where, attribute_map=getattr(config_cls, "attribute_map", {}))
    try:
        config = config_cls.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except Exception as exc:  # transformers raises TypeError, ValueError or huggingface_hub's StrictDataclassError
        if not isinstance(exc, (TypeError, ValueError)) and type(exc).__name__ not in _CONFIG_ERRORS:
            raise
        raise InputError(f"{where}: invalid config: {_one_line(exc)}") from None
    return _check_estimator_fields(config, where)


# huggingface_hub's @strict validation errors (transformers 5 configs are strict dataclasses)
_CONFIG_ERRORS = ("StrictDataclassError", "StrictDataclassFieldValidationError", "StrictDataclassDefinitionError")


def _check_estimator_fields(config: Any, where: str, attribute_map: dict[str, str] | None = None) -> Any:
    """Refuse a non-positive ESTIMATOR_FIELDS value; `config` is a dict (raw JSON) or a built config.

    On a built config the text model's fields are checked (a vision-language model keeps them in
    text_config), encoder-decoder models also by their decoder depth. Fields the config does not
    have are left to transformers' defaults.
    """
    if isinstance(config, dict):
        fields = {attribute_map.get(name, name) if attribute_map else name: name for name in ESTIMATOR_FIELDS}
        values = {spelled: config.get(spelled) for spelled in fields}
    else:
        text = config.get_text_config()
        mapping = getattr(text, "attribute_map", {}) or {}
        names = list(ESTIMATOR_FIELDS) + (["num_decoder_layers"] if getattr(config, "is_encoder_decoder", False) else [])
        values = {mapping.get(name, name): getattr(text, name, None) for name in names}
    for spelled, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise InputError(f"{where}: field {spelled} must be a positive integer, got {value!r}")
    return config


def _remote_config(where: str) -> Any:
    from transformers import AutoConfig

    folder = Path(where).parent
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


def _config_from_hub(model: str, *, trust_remote_code: bool, allow_network: bool) -> tuple[Any, str] | None:
    if not allow_network and not _in_hf_cache(model):
        return None  # said without importing transformers (and torch): a mistyped name is a quick error
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            model, local_files_only=not allow_network, trust_remote_code=trust_remote_code
        )
    except OSError:
        return None
    except ValueError as exc:
        message = str(exc).splitlines()[0]
        if "trust_remote_code" in message:
            raise InputError(f"{model}: needs remote code; rerun with --trust-remote-code if you trust it") from None
        raise InputError(f"{model}: invalid config: {message}") from None
    return _check_estimator_fields(config, model), "hub" if allow_network else "hf-cache"


def _in_hf_cache(model: str) -> bool:
    """Whether the local Hugging Face cache holds a config.json for the repo id `model` (huggingface_hub's
    own lookup, the one transformers makes with local_files_only)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except HFValidationError:  # not a repo id
        return False


ConfigField = Callable[[str], Any]
"""A config's field by name, None where it has none: getattr on a transformers config, or `dict.get`
on its JSON (what `anatomist models` reads, without importing transformers)."""


def moe_counts(config: Any) -> tuple[int, int] | None:
    """(experts per token, routed experts) for a Mixture-of-Experts config, else None (see `experts_of`)."""
    text = config.get_text_config()
    return experts_of(lambda name: getattr(text, name, None))


def experts_of(field: ConfigField) -> tuple[int, int] | None:
    """(experts per token, routed experts) of a text config's fields, else None.

    The expert count goes by num_local_experts (Mixtral, gpt-oss), num_experts (Qwen-MoE) or
    n_routed_experts (DeepSeek); shared experts are not counted.
    """
    experts = field("num_local_experts") or field("num_experts") or field("n_routed_experts")
    per_token = field("num_experts_per_tok")
    if experts and per_token:
        return int(per_token), int(experts)
    return None


def context_length(field: ConfigField, model_type: str) -> int | None:
    """Longest sequence a text config's position embeddings allow, None where nothing limits it."""
    for name in ("max_position_embeddings", "n_positions"):
        value = field(name)
        if isinstance(value, int) and value > 0:
            pad = field("pad_token_id")
            if model_type in _POSITIONS_AFTER_PADDING and isinstance(pad, int) and 0 <= pad < value - 1:
                return value - pad - 1  # RoBERTa: 514 embeddings, padding_idx 1 -> 512 tokens
            return value
    return None
