"""How the training state is split across devices: data parallelism, DeepSpeed ZeRO, PyTorch FSDP.

Each spec names the Recipe fields that make it, the ZeRO-equivalent stage (what it partitions:
1 optimizer states, 2 also gradients, 3 also weights; Rajbhandari et al. 2020, "ZeRO", sec. 5),
its engine and whether it offloads, on how many devices it is searched, and whether it is
searched for adapters: LoRA/QLoRA's gradients and optimizer states are too small for ZeRO-1/2 to
pay, but sharding the frozen base is what fits a 70B model on two 24 GB cards (FSDP + QLoRA:
Answer.AI's fsdp_qlora, bitsandbytes' and PEFT's FSDP-QLoRA guides; ZeRO-3 + QLoRA: PEFT's DeepSpeed
guide), so FSDP full_shard and ZeRO-3 are searched for adapters too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

Fsdp = Literal["none", "full_shard", "shard_grad_op"]
"""`TrainingArguments.fsdp` strategies anatomist models (FSDP2's, `trace/step/fsdp.py`)."""
FSDP_MODES: tuple[str, ...] = get_args(Fsdp)
Offload = Literal["none", "cpu", "nvme"]
"""Where DeepSpeed ZeRO offloads (nvme: stage 3 only); with FSDP, cpu is its CPUOffloadPolicy."""
OFFLOADS: tuple[str, ...] = get_args(Offload)
EpRouting = Literal["balanced", "skewed"]
"""The routing an expert parallel step is traced with (trace/step/experts.py `routed_as`): balanced, as the auxiliary
load-balancing loss aims, or skewed, every token of every rank sent to as many of the traced rank's experts as it can
take (the most that rank can receive: the high end of the estimate's range)."""
EP_ROUTINGS: tuple[str, ...] = get_args(EpRouting)

FSDP_STAGES: dict[str, int] = {"full_shard": 3, "shard_grad_op": 2}
"""The ZeRO stage each `TrainingArguments.fsdp` strategy partitions like (Zhao et al. 2023, "PyTorch
FSDP", sec. 3: FULL_SHARD shards weights, gradients and optimizer state; SHARD_GRAD_OP keeps the
weights whole between forward and backward)."""

RESHARD_AFTER_FORWARD: dict[str, bool] = {"full_shard": True, "shard_grad_op": False}
"""FSDP2's `fully_shard(reshard_after_forward=...)` for each `TrainingArguments.fsdp` strategy (transformers
5.23, `TrainingArguments._apply_legacy_fsdp_to_config`: full_shard -> True, shard_grad_op -> False; FSDP2
is the Trainer's default, `fsdp_config["version"] = 2`)."""

FSDP_CONFIG_ONLY = (5, 10)
"""From transformers 5.10, `TrainingArguments(fsdp=True)` reads everything from `fsdp_config` (`version`, default 2;
`reshard_after_forward`; `cpu_offload`; the transformer-based wrap by default) and a string `fsdp` is deprecated
(`_apply_legacy_fsdp_to_config`). Before (5.4-5.9), `fsdp` is a string of options: the strategy, "auto_wrap" (else
accelerate wraps nothing: the whole model one unit) and "offload", and FSDP1 is the default (`version` 1)."""


def trainer_fsdp_arguments(fsdp: str, *, offload: bool, adapters: bool,
                           transformers_version: str | None = None) -> dict[str, object]:
    """TrainingArguments' `fsdp` and `fsdp_config` for FSDP2 with `fsdp`'s strategy, each block its own unit (as
    anatomist traces it: `trace.step.fsdp`), CPU offload where asked, and, for adapters, PEFT's
    `cpu_ram_efficient_loading`; in the form `transformers_version` (default: the one installed, else the newest)
    reads (`FSDP_CONFIG_ONLY`)."""
    config: dict[str, object] = {"version": 2}
    if adapters:
        config["cpu_ram_efficient_loading"] = True
    if release(transformers_version or installed("transformers")) >= FSDP_CONFIG_ONLY:
        config["reshard_after_forward"] = RESHARD_AFTER_FORWARD[fsdp]
        if offload:
            config["cpu_offload"] = True
        return {"fsdp": True, "fsdp_config": config}
    return {"fsdp": " ".join([fsdp, "auto_wrap", *(["offload"] if offload else [])]), "fsdp_config": config}


FSDP2_ACCELERATE = (1, 6)
"""accelerate's first release with FSDP2 (`FullyShardedDataParallelPlugin.fsdp_version`): an older one runs an FSDP
config as FSDP1, whatever version it names."""
PARALLELISM_CONFIG_ACCELERATE = (1, 10)
"""accelerate's first release with `ParallelismConfig` (accelerate/parallelism_config.py), which HSDP's replicas need:
an older one reads no `parallelism_config` and shards over every GPU."""
SEQUENCE_PARALLEL_ACCELERATE = (1, 12)
"""accelerate's first release with ParallelismConfig's `sp_size` (DeepSpeed's Ulysses: transformers' deepspeed_alst.md
"requires Accelerate v1.12.0")."""


def installed(package: str) -> str | None:
    """The installed version of `package` (from its metadata: nothing is imported), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str | None) -> tuple[int, ...]:
    """(major, minor) of a version string; the newest where there is none."""
    if version is None:
        return (10**6,)
    return tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingSpec:
    """One way of spreading the training state over the data-parallel devices."""

    name: str
    description: str
    fields: dict[str, object] = field(default_factory=dict)
    """The Recipe fields that make it (none: every device holds everything)."""
    stage: Literal[0, 1, 2, 3]
    """ZeRO-equivalent stage: what is partitioned across the devices."""
    engine: Literal["none", "deepspeed", "fsdp"]
    offload: bool = False
    """Optimizer state (and at stage 3 the weights) kept in host memory."""
    devices: Literal["one", "many", "nodes"]
    """Searched on one device, on several, or on several nodes only."""
    for_adapters: bool = False
    """Searched for LoRA/QLoRA too."""

    @property
    def fsdp(self) -> str:
        """Its `TrainingArguments.fsdp` ("none" for the others)."""
        return str(self.fields.get("fsdp", "none"))


_SPECS = (
    ShardingSpec(name="none", description="one device holds everything", stage=0, engine="none", devices="one",
                 for_adapters=True),
    ShardingSpec(name="zero2+offload", description="ZeRO-Offload: optimizer state and step on the host",
                 fields={"zero_stage": 2, "offload": "cpu"}, stage=2, engine="deepspeed", offload=True, devices="one"),
    ShardingSpec(name="ddp", description="data parallel: every device holds everything, gradients all-reduced",
                 stage=0, engine="none", devices="many", for_adapters=True),
    ShardingSpec(name="zero1", description="ZeRO-1: optimizer states partitioned", fields={"zero_stage": 1}, stage=1,
                 engine="deepspeed", devices="many"),
    ShardingSpec(name="zero2", description="ZeRO-2: optimizer states and gradients partitioned",
                 fields={"zero_stage": 2}, stage=2, engine="deepspeed", devices="many"),
    ShardingSpec(name="zero3", description="ZeRO-3: optimizer states, gradients and weights partitioned",
                 fields={"zero_stage": 3}, stage=3, engine="deepspeed", devices="many", for_adapters=True),
    ShardingSpec(name="zero2+offload", description="ZeRO-2 with optimizer state and step on the host",
                 fields={"zero_stage": 2, "offload": "cpu"}, stage=2, engine="deepspeed", offload=True,
                 devices="many"),
    ShardingSpec(name="zero3+offload", description="ZeRO-3 with optimizer state, step and weights on the host",
                 fields={"zero_stage": 3, "offload": "cpu"}, stage=3, engine="deepspeed", offload=True,
                 devices="many"),
    ShardingSpec(name="fsdp_shard_grad_op", description="FSDP SHARD_GRAD_OP: like ZeRO-2",
                 fields={"fsdp": "shard_grad_op"}, stage=2, engine="fsdp", devices="many"),
    ShardingSpec(name="fsdp_full_shard", description="FSDP FULL_SHARD: like ZeRO-3", fields={"fsdp": "full_shard"},
                 stage=3, engine="fsdp", devices="many", for_adapters=True),
    ShardingSpec(name="hsdp", description="HSDP: FSDP FULL_SHARD within each node, replicated across the nodes",
                 fields={"fsdp": "full_shard"}, stage=3, engine="fsdp", devices="nodes", for_adapters=True),
)


UNSHARDED: dict[str, object] = {"zero_stage": 0, "offload": "none", "fsdp": "none", "tp_size": 1, "ep_size": 1,
                                 "cp_size": 1, "sp_size": 1, "dp_replicate_size": 1}
"""The Recipe fields of no sharding at all: what a sharding's own `fields` are laid over."""

SHARDING_NAMES = tuple(dict.fromkeys(spec.name for spec in _SPECS))
"""Every sharding option's name (`plan --shardings`), in search order."""


def shardings_for(num_gpus: int, nodes: int = 1) -> dict[str, ShardingSpec]:
    """The sharding options searched on `num_gpus` devices over `nodes` nodes, by name, in search order; a "nodes"
    one (HSDP) with its replicas, one per node (`dp_replicate_size`: accelerate's ParallelismConfig, which shards
    within a replica's consecutive ranks, a node's)."""
    devices = ("many", "nodes") if nodes > 1 else ("many",) if num_gpus > 1 else ("one",)
    return {spec.name: replicated(spec, nodes) for spec in _SPECS if spec.devices in devices}


def replicated(spec: ShardingSpec, nodes: int) -> ShardingSpec:
    """`spec` with one replica per node where it replicates across the nodes (HSDP); else `spec`."""
    if spec.devices != "nodes":
        return spec
    return dataclasses.replace(spec, fields={**spec.fields, "dp_replicate_size": nodes})


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepSpeedSetting:
    """A ZeRO config value that sizes one of DeepSpeed's own buffers: what a run takes when the config
    leaves it out or says "auto", and where that comes from."""

    field: str
    """Its Recipe field (and key of `zero_optimization`)."""
    default: int
    """DeepSpeed's default where the config leaves it out (deepspeed 0.19 runtime/zero/config.py
    DeepSpeedZeroConfig)."""
    auto: bool
    """Whether transformers' `HfTrainerDeepSpeedConfig.trainer_config_finalize` fills "auto" from the
    model's hidden size h (`AUTO_FROM_HIDDEN_SIZE`); "auto" elsewhere is an error in the Trainer."""


DEEPSPEED_SETTINGS: dict[str, DeepSpeedSetting] = {s.field: s for s in (
    DeepSpeedSetting(field="reduce_bucket_size", default=500_000_000, auto=True),
    DeepSpeedSetting(field="allgather_bucket_size", default=500_000_000, auto=False),
    DeepSpeedSetting(field="stage3_prefetch_bucket_size", default=50_000_000, auto=True),
    DeepSpeedSetting(field="stage3_max_live_parameters", default=1_000_000_000, auto=False),
    DeepSpeedSetting(field="stage3_max_reuse_distance", default=1_000_000_000, auto=False),
    DeepSpeedSetting(field="stage3_param_persistence_threshold", default=100_000, auto=True),
)}
"""The ZeRO values the estimate reads. A recipe that leaves one unset means what the HF docs' ZeRO
configs write: "auto" for the three the Trainer fills, DeepSpeed's default for the others; `plan
--emit deepspeed` writes it so. A DeepSpeed file that leaves one out gets DeepSpeed's default
(recipe/files/deepspeed.py)."""


def auto_from_hidden_size(hidden_size: int) -> dict[str, int]:
    """What `HfTrainerDeepSpeedConfig.trainer_config_finalize` (transformers 5.x, integrations/deepspeed.py)
    writes for "auto": reduce_bucket_size = h*h; under ZeRO-3 stage3_prefetch_bucket_size = int(0.9*h*h)
    and stage3_param_persistence_threshold = 10*h."""
    h = hidden_size
    return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}


def deepspeed_values(hidden_size: int, given: dict[str, int | None]) -> dict[str, int]:
    """Each DEEPSPEED_SETTINGS value: `given`'s where set, else "auto" filled from `hidden_size` as
    transformers fills it, else DeepSpeed's default."""
    auto = auto_from_hidden_size(hidden_size)
    values = {}
    for name, setting in DEEPSPEED_SETTINGS.items():
        value = given.get(name)
        values[name] = value if value is not None else auto[name] if setting.auto else setting.default
    return values
