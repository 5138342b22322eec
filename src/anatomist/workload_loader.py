"""MODEL to a Workload: the config found and checked (`model_config`), what the estimator reads of it
(`model_facts.ModelFacts`), the task, the sequence length and the data's token statistics, settled here once.

The facts of a config.json already read with this transformers are kept in the trace cache, and so is PEFT's
answer to which modules LoRA targets by default (asked of PEFT itself on the model cut to one block,
`trace.step.peft_defaults`): a repeated estimate imports neither transformers nor torch. This module, not
`workload`, reaches into trace/: a Workload is what the tracer takes, so it imports nothing of it.
"""

from __future__ import annotations

from typing import Any

from anatomist.errors import InputError
from anatomist.model_config import FoundConfig, checked_config, config_from_dict, find_config
from anatomist.model_facts import TASKS, LoraDefaults, ModelFacts, facts_of
from anatomist.token_stats import read_lengths, stats_from_mean
from anatomist.workload import PEFT_TASK_TYPES, Task, Workload, canonical_json


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
    found = find_config(model, trust_remote_code=trust_remote_code, allow_network=allow_network)
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
    workload = _workload(name, FoundConfig(checked_config(data, name), name, "live"), seq_len=seq_len, task=task,
                         trust_remote_code=trust_remote_code)
    workload.num_labels = num_labels
    return workload


def _workload(model: str, found: FoundConfig, *, seq_len: int | None, task: Task | None,
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
                    built_config=built, hub_id=found.hub_id, config_note=found.note, lora_defaults=stored_lora_defaults)


def _facts(found: FoundConfig, trust_remote_code: bool) -> tuple[ModelFacts, Any]:
    """The facts of `found`'s config and the transformers config if it had to be built for them: from the
    trace cache where this config.json was read before with this transformers (no import), else read."""
    from anatomist.trace.store import cache

    built: list[Any] = [found.built]

    def read() -> ModelFacts:
        if built[0] is None:
            built[0] = config_from_dict(found.data, found.where, trust_remote_code, code_folder=found.code_folder)
        return facts_of(built[0])

    facts = cache.get_or_trace(("model-facts", canonical_json(found.data), trust_remote_code), read, ModelFacts)
    return facts, built[0]


def stored_lora_defaults(workload: Workload) -> tuple[str, ...] | None:
    """The modules PEFT's LoraConfig targets in `workload`'s model when none are named, None where PEFT has no default
    for it (`trace.step.peft_defaults`, asked once per config, task and peft version: the trace cache)."""
    from anatomist.trace.store import cache

    def ask_peft() -> LoraDefaults:
        from anatomist.trace.step.peft_defaults import default_targets

        return LoraDefaults(targets=default_targets(workload, PEFT_TASK_TYPES.get(workload.task)))

    key = ("lora-defaults", canonical_json(workload.config_json), workload.task, workload.num_labels,
           workload.trust_remote_code)
    return cache.get_or_trace(key, ask_peft, LoraDefaults).targets
