"""DeepSpeed's Ulysses sequence parallel (ALST) on the traced model, as transformers' Trainer runs it under accelerate's
ParallelismConfig(sp_size=P, sp_backend="deepspeed").

A recipe with `sp_size` P > 1 is a DeepSpeed ZeRO recipe whose every sequence is split into P contiguous parts, one per
GPU of a group (DeepSpeed's `UlyssesSPDataLoaderAdapter`); the step of one rank is traced (S / P tokens) on a fake
process group of P ranks, and ZeRO stays arithmetic over that trace (`estimate.sharding`: it partitions over every GPU,
DeepSpeed's `seq_data_parallel_group`). What differs from one device's step:
- the batch: the adapter hands a rank `shift_labels` and the position ids of its part, and transformers'
  `deepspeed_sp_compute_loss` passes the shifted labels as the labels (`context_parallel.as_the_trainer_gives_it`,
  the same keys the Trainer makes under context parallel);
- the attention: accelerate calls DeepSpeed's own `UlyssesSPAttentionHF.register_with_transformers`, which puts its
  wrapper in transformers' attention registry in place of SDPA (`ulysses_attention` does the same, and puts SDPA back
  after): the mask dropped (SDPA then runs `is_causal`), the rank's queries, keys and values exchanged by an
  all-to-all (`deepspeed::dim_zero_all_to_all`) for the whole sequence of 1 / P of the heads (grouped key and value
  heads repeated where there are fewer than P), SDPA on them, and the output exchanged back; in backward the same
  exchanges run the other way. The all-gather of the position ids is DeepSpeed's too.

Not traced: the loss's all-gather across the group (`deepspeed_sp_compute_loss`: two scalars per rank).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

from anatomist.errors import InputError


@contextlib.contextmanager
def ulysses_attention(model: torch.nn.Module, sp_size: int, batch_size: int) -> Iterator[None]:
    """SDPA (which also stands for flash_attention_2: `keys.traced_attention`) in transformers' attention registry
    replaced by DeepSpeed's Ulysses wrapper over ranks 0 .. sp_size - 1 of the current (fake) world, registered by
    DeepSpeed's own `register_with_transformers` as accelerate calls it (every sequence length allowed: the Trainer's
    default `sp_seq_length_is_variable`); SDPA and DeepSpeed's groups restored after."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    comm = _deepspeed_comm()
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    sdpa, backend = ALL_ATTENTION_FUNCTIONS["sdpa"], comm.cdb
    try:
        comm.cdb = _torch_backend()
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp_size,
            micro_batch_size=batch_size, seq_length_is_variable=True, disable_in_eval=True)
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"], comm.cdb = sdpa, backend
        parallel_state_sp._release_sequence_parallel_groups()


def _deepspeed_comm() -> Any:
    """DeepSpeed's communication module, imported without the line it prints where it finds no GPU (its logger's
    handler is pointed back at stdout after)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from deepspeed.comm import comm
    except ImportError as e:
        raise InputError("sp_size traces DeepSpeed's own Ulysses attention, and DeepSpeed is not installed here: pip "
                         "install deepspeed") from e
    for handler in logging.getLogger("DeepSpeed").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stdout)
    return comm


def _torch_backend() -> Any:
    """DeepSpeed's backend over the torch process group already there (the fake world), as `init_distributed` makes
    it where torch's is initialized, less the shared-memory all-reduce it compiles for a CPU accelerator (a GPU run
    has none)."""
    backends: Any = importlib.import_module("deepspeed.comm.torch")  # the package's `torch` is torch itself
    build = backends.build_shm_op
    backends.build_shm_op = lambda: None
    try:
        return backends.TorchBackend(None, None, None)
    finally:
        backends.build_shm_op = build
