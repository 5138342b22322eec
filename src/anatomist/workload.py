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

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from anatomist.errors import InputError
from anatomist.model_catalog import METADATA_KEY, catalog_entries, find_entry

Task = Literal["sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm"]
TASKS: tuple[str, ...] = ("sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm")



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

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    def trace_key(self) -> tuple[Any, ...]:
        """What decides the model a trace builds and the inputs it feeds: the caches' key."""
        return (self.config.to_json_string(use_diff=False), self.task, self.num_labels, self.seq_len)

    @property
    def is_moe(self) -> bool:
        return moe_counts(self.config) is not None

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the config's position embeddings allow, None where nothing limits it."""
        config = self.config.get_text_config()
        for attr in ("max_position_embeddings", "n_positions"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def build_model(self, attn_implementation: str = "sdpa") -> Any:
        """Instantiate the task model from the config (random init, no weights loaded).

        The weights are fp32 whatever the config's `dtype` says (transformers 5 would build a
        bf16 Llama): mixed precision keeps fp32 master weights and casts per op, which is what
        the recipes' precisions mean (the seeds' bytes per parameter). Mixture-of-Experts
        models keep the config's dtype: transformers 5 runs their experts through
        `grouped_mm`, which takes bf16 weights only, so they train in bf16 whatever the recipe.
        """
        import torch
        import transformers

        auto = {
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "causal-lm": transformers.AutoModelForCausalLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
            "masked-lm": transformers.AutoModelForMaskedLM,
        }[self.task]
        config = self.config
        if self.task == "sequence-classification":
            config.num_labels = self.num_labels
            if getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = 0  # decoder classifiers need one to find the last token
        dtype = {} if self.is_moe else {"dtype": torch.float32}  # from_config's default: the config's dtype
        try:
            return auto.from_config(
                config, attn_implementation=attn_implementation, trust_remote_code=self.trust_remote_code, **dtype
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
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    if config.model_type in ("bert", "roberta", "deberta", "deberta-v2", "distilbert", "albert", "electra"):
        return "sequence-classification"  # the seeds' experiment
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
    """Build the transformers config a config.json describes (the catalog's own key dropped).

    Raises:
        InputError: one line naming the field and the value.
    """
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k != METADATA_KEY}
    model_type = data.get("model_type")
    if not model_type:
        raise InputError(f"{where}: field model_type is missing; it names the architecture (e.g. \"bert\", \"llama\")")
    if "auto_map" in data and not trust_remote_code and model_type not in CONFIG_MAPPING:
        raise InputError(f"{where}: this model needs remote code (auto_map); rerun with --trust-remote-code if you trust it")
    if model_type not in CONFIG_MAPPING:
        raise InputError(f"{where}: field model_type={model_type!r} is not an architecture transformers knows")
    config_cls = CONFIG_MAPPING[model_type]
    for name, value in data.items():
        if name.endswith(("_size", "_layers", "_heads")) and not (isinstance(value, int) and value > 0):
            if value is not None:
                raise InputError(f"{where}: field {name} must be a positive integer, got {value!r}")
    try:
        return config_cls.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: invalid config: {str(exc).splitlines()[0]}") from None


def _config_from_hub(model: str, *, trust_remote_code: bool, allow_network: bool) -> tuple[Any, str] | None:
    if "/" not in model and not allow_network:
        # A bare name that is not in the catalog may still be cached under its own id.
        pass
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
    return config, "hub" if allow_network else "hf-cache"


def moe_counts(config: Any) -> tuple[int, int] | None:
    """(experts per token, routed experts) for a Mixture-of-Experts config, else None.

    The expert count goes by num_local_experts (Mixtral, gpt-oss), num_experts (Qwen-MoE) or
    n_routed_experts (DeepSeek); shared experts are not counted.
    """
    config = config.get_text_config()
    experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               or getattr(config, "n_routed_experts", None))
    per_token = getattr(config, "num_experts_per_tok", None)
    if experts and per_token:
        return int(per_token), int(experts)
    return None
