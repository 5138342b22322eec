"""Workload: which model (config only, never weights), which task head, which inputs.

A Workload holds the config.json as read (`config_json`: what the trace caches key on) and what
the estimator reads of it (`facts`, `model_facts.ModelFacts`). The transformers config (`config`)
is built only when something needs it (building a model to trace). `workload_loader.load_workload`
makes one from MODEL (found and checked by `model_config`); the tracer takes it, so this module
imports nothing of trace/.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from anatomist.errors import InputError
from anatomist.model_catalog import resolve
from anatomist.model_config import config_from_dict
from anatomist.model_facts import ModelFacts
from anatomist.token_stats import TokenStats

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
    lora_defaults: Callable[[Workload], tuple[str, ...] | None] | None = field(default=None, repr=False, compare=False)
    """How PEFT's default LoRA targets for this model are found (`workload_loader.stored_lora_defaults`: PEFT is asked
    on the model cut to one block, the tracer's work), given by whoever made the Workload; None: not given."""
    _trace_key: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _model_key: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)

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
            self._trace_key = (*self.model_key(), self.seq_len, *prompt)
        return self._trace_key

    def model_key(self) -> tuple[Any, ...]:
        """What decides the model alone, at any length of its samples: `trace_key` less the inputs."""
        if self._model_key is None:
            self._model_key = (canonical_json(self.config_json), self.task, self.num_labels)
        return self._model_key

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
        for it (`lora_defaults`, which the loader gives).

        Raises:
            RuntimeError: a Workload made without `lora_defaults` (not by `workload_loader`).
        """
        if self.lora_defaults is None:
            raise RuntimeError(f"{self.name}: a Workload made without lora_defaults cannot ask PEFT for its default "
                               "LoRA targets; make it with workload_loader.load_workload or workload_from_config")
        return self.lora_defaults(self)

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
