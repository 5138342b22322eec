"""What the estimator reads of a model's config, read through transformers once and then kept.

Everything an estimate needs from the transformers config beyond what its traces hold: the task it
defaults to, how long a sequence may be, the load dtype "auto" means, the vocabulary and hidden size, its experts.
`facts_of` reads them from a built config; `workload_loader.load_workload` keeps them in the trace cache
under the config.json's own content, so a repeated estimate of that config reads them from disk
without importing transformers (or torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anatomist.config_fields import context_length, experts_of

TASKS: tuple[str, ...] = ("sequence-classification", "causal-lm", "seq2seq-lm", "masked-lm")

# Encoders that transformers also gives a causal-LM class (BertLMHeadModel, ...): still encoders.
_ENCODER_TYPES = ("bert", "roberta", "deberta", "deberta-v2", "distilbert", "albert", "electra")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """A model config as the estimator reads it."""

    model_type: str
    default_task: str
    """seq2seq-lm for encoder-decoders, sequence classification for encoders, else causal-lm."""
    max_positions: int | None
    """Longest sequence the position embeddings allow (None: nothing limits it)."""
    config_dtype: str
    """What `from_pretrained(dtype="auto")` loads the weights in: the config's dtype, else float32."""
    vocab_size: int
    """The text model's vocabulary."""
    hidden_size: int
    """The text model's hidden size (0 where its config names none)."""
    experts: tuple[int, int] | None
    """(experts per token, routed experts) of a Mixture-of-Experts model, None for a dense one."""
    experts_implementation: str | None
    """The experts kernel the config itself names (transformers then runs it whatever is asked)."""
    kernel_tasks: tuple[str, ...]
    """The tasks whose model class runs its experts through transformers' kernels (`trace.step.experts`)."""
    eager_tasks: tuple[str, ...] = ()
    """The tasks whose model class has no SDPA attention (`_supports_sdpa` False: DeBERTa-v2, gpt-oss): transformers
    builds them with eager attention where none is asked for (`get_correct_attn_implementation`)."""


def facts_of(config: Any) -> ModelFacts:
    """The facts of a built transformers config (imports transformers)."""
    text = config.get_text_config()

    def field(name: str) -> Any:
        return getattr(text, name, None)

    experts = experts_of(field)
    return ModelFacts(
        model_type=str(config.model_type), default_task=_default_task(config),
        max_positions=context_length(field, str(config.model_type)), config_dtype=_config_dtype(config),
        vocab_size=int(text.vocab_size), hidden_size=int(field("hidden_size") or 0), experts=experts,
        experts_implementation=getattr(config, "_experts_implementation", None),
        kernel_tasks=_kernel_tasks(config) if experts else (), eager_tasks=_eager_tasks(config),
    )


@dataclass(frozen=True, slots=True)
class LoraDefaults:
    """What PEFT's LoraConfig targets in a model when `target_modules` is unset (`trace.step.peft_defaults`)."""

    targets: tuple[str, ...] | None
    """The module names PEFT picks, None where it finds none (no default for the model type)."""


def _default_task(config: Any) -> str:
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


def _config_dtype(config: Any) -> str:
    """The dtype the config names, else float32. (A config.json's older `torch_dtype` is read into
    `dtype` by transformers >= 5, whose `torch_dtype` attribute only repeats it with a warning.)"""
    value = getattr(config, "dtype", None)
    name = str(value).removeprefix("torch.") if value is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def task_model_class(config: Any, task: str) -> type | None:
    """The transformers class of `task` for `config` (None: remote code, or no such head)."""
    from transformers.models.auto import modeling_auto as auto

    mapping = {
        "causal-lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING,
        "sequence-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        "seq2seq-lm": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
        "masked-lm": auto.MODEL_FOR_MASKED_LM_MAPPING,
    }[task]
    try:
        cls: Any = mapping[type(config)]
    except KeyError:
        return None
    return cls if isinstance(cls, type) else None


def _kernel_tasks(config: Any) -> tuple[str, ...]:
    """Tasks whose class runs its experts through transformers' kernels (its own test: the class's
    module uses the `use_experts_implementation` decorator)."""
    classes = {task: task_model_class(config, task) for task in TASKS}
    return tuple(t for t, cls in classes.items() if cls is not None and cls._can_set_experts_implementation())  # type: ignore[attr-defined]


def _eager_tasks(config: Any) -> tuple[str, ...]:
    """Tasks whose class has no SDPA attention: transformers' default (`attn_implementation=None`) tries SDPA and
    falls back to eager there. A class not known here (remote code) is left to SDPA, as before."""
    classes = {task: task_model_class(config, task) for task in TASKS}
    return tuple(t for t, cls in classes.items() if cls is not None and not getattr(cls, "_supports_sdpa", False))
