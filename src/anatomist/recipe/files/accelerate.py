"""An accelerate config, as `accelerate config` writes it and `accelerate launch --config_file` reads it.

Key names are accelerate's `ClusterConfig` (accelerate/commands/config/config_args.py) and the
`accelerate launch` options its sections hold (`deepspeed_config.zero_stage`,
`fsdp_config.fsdp_sharding_strategy`, ...). It says how the script runs (precision, engine,
devices), not the batch: that comes from the flags, or the defaults.

Read as strictly as accelerate reads it: a top-level key ClusterConfig lacks is refused
(`ClusterConfig.from_yaml_file`: "had unknown keys"), and so is a key of a section that is no
`accelerate launch` option once accelerate prefixes it (launch.py `_validate_launch_command`:
fsdp_config.x -> --fsdp_x), nor an argument the environment it prepares reads (utils/launch.py:
fsdp_ignored_modules): accelerate would set it and nothing would read it. Settings that
change memory but are not modelled yet are refused, never predicted as something else:
context parallel's "alltoall" rotation in `parallelism_config`, activation offload
(`fsdp_activation_checkpointing_offload`). FSDP's CPU offload (`fsdp_offload_params`) is the recipe's
offload="cpu". `parallelism_config.parallelism_config_tp_size` is the recipe's tp_size, traced as transformers splits
the model, without FSDP; with FSDP it is refused (TP_UNDER_ACCELERATE_FSDP). `parallelism_config_dp_replicate_size` is
the recipe's dp_replicate_size (HSDP: FSDP's shard groups replicated, as accelerate's FSDP2 shards on its 2-D mesh),
`parallelism_config_cp_size` its cp_size (torch's ring attention with accelerate's default "allgather" rotation),
`parallelism_config_sp_size` its sp_size (DeepSpeed's Ulysses, whose attention `parallelism_config_sp_attn_implementation`
names: the recipe's attn_implementation).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from anatomist.errors import InputError
from anatomist.recipe.files.deepspeed import read_deepspeed
from anatomist.recipe.files.known import refuse_unknown
from anatomist.recipe.files.reading import (
    Reading,
    fsdp_mode,
    fsdp_offload,
    load_mapping,
    parallel_size,
    referenced_file,
    zero_offload,
)
from anatomist.recipe.files.unmodelled import TP_UNDER_ACCELERATE_FSDP, refuse_unmodelled

MARKERS = ("compute_environment", "distributed_type")
ENGINES = ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP")
"""The distributed types anatomist models: one device, data parallel, DeepSpeed ZeRO, PyTorch FSDP."""
WRITTEN_BY_DEFAULT = {"compute_environment": "LOCAL_MACHINE", "gpu_ids": "all"}
"""What `accelerate config` writes where ClusterConfig has no default or another one."""
SECTION_PREFIXES = {"fsdp_config": "fsdp_", "dynamo_config": "dynamo_", "fp8_config": "fp8_",
                    "deepspeed_config": "", "parallelism_config": ""}
"""The sections whose keys become `accelerate launch` options, and the prefix launch.py gives a key that lacks it."""
READ_SIZES = {"parallelism_config_tp_size": "tp_size", "parallelism_config_dp_replicate_size": "dp_replicate_size",
              "parallelism_config_cp_size": "cp_size", "parallelism_config_sp_size": "sp_size"}
"""parallelism_config sizes read as the recipe's fields (tensor parallel; HSDP's replicas of FSDP's shards; context
parallel; DeepSpeed's sequence parallel)."""
IMPLIED = ("parallelism_config_dp_shard_size", "parallelism_config_cp_comm_strategy", "parallelism_config_cp_backend",
           "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
           "parallelism_config_sp_seq_length_is_variable")
"""parallelism_config keys the recipe holds otherwise: FSDP's shard size is what the GPUs leave beside the other sizes
(accelerate refuses a product other than its processes), the ring's rotation is refused unless it is the traced one
(`CP_ROTATION`), "torch" and "deepspeed" are the one backend of each that accelerate's ParallelismConfig takes, and a
fixed sequence parallel length is the sequence's (the batches are padded to it)."""
SP_ATTENTION = "parallelism_config_sp_attn_implementation"
"""The attention DeepSpeed's Ulysses wraps (accelerate's DeepSpeedSequenceParallelConfig), which must be the model's
own (DeepSpeed refuses another): read as the recipe's attn_implementation."""
CP_ROTATION = "parallelism_config_cp_comm_strategy"
"""How torch's ring passes the keys and values (accelerate's TorchContextParallelConfig): "allgather", its default,
is what anatomist traces; "alltoall" passes one rank's part at a time (other buffers): refused."""
PASSED_NOWHERE = {"deepspeed_config": ("seq_parallel_communication_data_type",)}
"""Section keys that are DeepSpeed's own config keys, which accelerate launch takes and passes to no one (its DeepSpeed
plugin builds the config from its own fields): TRL's ALST example sets this one; DeepSpeed reads it from its JSON only
(the dtype of the gradients' reduction under sequence parallel, which is not modelled)."""
MULTI_NODE = ("same_network", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend")
"""Keys that say where the machines meet: nothing the prediction reads, whatever they say (num_machines sets
the nodes the time model spreads the devices over)."""


def looks_like_accelerate(data: dict[str, Any]) -> bool:
    return any(key in data for key in MARKERS)


@cache
def launch_options() -> frozenset[str]:
    """What `accelerate launch` reads of a section's keys: its parser's options, and the attributes of its arguments
    the environment it prepares reads without an option (utils/launch.py: getattr(args, "fsdp_ignored_modules", None));
    empty where accelerate is not installed."""
    try:
        from accelerate.commands.launch import launch_command_parser
        from accelerate.utils import launch as environment
    except ImportError:
        return frozenset()
    return frozenset({action.dest for action in launch_command_parser()._actions} | _arguments_read(environment))


def _arguments_read(module: Any) -> set[str]:
    """The attributes of `args` that `module`'s source reads: `args.x` and `getattr(args, "x", ...)`."""
    import ast
    import inspect

    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return names


def _check_keys(data: dict[str, Any], file: str) -> None:
    """accelerate's own refusals: a top-level key ClusterConfig lacks; here also a section key no launch option takes."""
    defaults = cluster_defaults()
    if not defaults:
        return
    from accelerate.commands.config.config_args import ClusterConfig

    refuse_unknown(data, ClusterConfig.__dataclass_fields__, file, "accelerate's config (ClusterConfig): "
                   "accelerate launch refuses it too")
    options = launch_options()
    for name, prefix in SECTION_PREFIXES.items():
        section = data.get(name)
        if isinstance(section, dict) and options:  # a key with or without its prefix: launch.py adds it
            known = {option for option in options if option.startswith(prefix)} | set(PASSED_NOWHERE.get(name, ()))
            refuse_unknown(section, known | {option.removeprefix(prefix) for option in known}, file,
                           f"accelerate launch's options for {name}", prefix=f"{name}.")


def _parallelism(section: dict[str, Any], file: str) -> None:
    for written in (CP_ROTATION, CP_ROTATION.removeprefix("parallelism_config_")):
        if section.get(written) not in (None, "allgather"):
            raise InputError(f"{file}: parallelism_config.{written}={section[written]!r} is not modelled yet (context "
                             "parallel is traced with torch's all-gather of the keys and values, accelerate's "
                             "default); use allgather or remove it")


def _sizes(section: Any, reading: Reading, file: str) -> Any:
    """parallelism_config's sizes (either spelling) as the recipe's (READ_SIZES; beside sequence parallel,
    dp_replicate_size counts DeepSpeed's data parallel ranks, no HSDP); the rest of the section."""
    if not isinstance(section, dict):
        return section
    read = set()
    sizes = READ_SIZES
    if any((section.get(w) or 1) > 1 for w in ("parallelism_config_sp_size", "sp_size")):
        sizes = {k: v for k, v in READ_SIZES.items() if v != "dp_replicate_size"}  # DeepSpeed's data parallel ranks
        read |= {"parallelism_config_dp_replicate_size", "dp_replicate_size"}
    for key, field in sizes.items():
        for written in (w for w in (key, key.removeprefix("parallelism_config_")) if w in section):
            parallel_size(reading, field, section[written], file, f"parallelism_config.{written}")
            read.add(written)
    for key in IMPLIED:
        read |= {key, key.removeprefix("parallelism_config_")}
    for written in (w for w in (SP_ATTENTION, SP_ATTENTION.removeprefix("parallelism_config_")) if w in section):
        if section[written] not in ("sdpa", "flash_attention_2"):
            raise InputError(f"{file}: parallelism_config.{written}={section[written]!r} is not modelled yet (sequence "
                             "parallel is traced around SDPA, or flash_attention_2 as SDPA stands for it)")
        reading.set("attn_implementation", section[written], file, f"parallelism_config.{written}")
        read.add(written)
    return {k: v for k, v in section.items() if k not in read}


@cache
def cluster_defaults() -> dict[str, Any]:
    """accelerate's ClusterConfig defaults, by key (an empty mapping where accelerate is not installed)."""
    try:
        from accelerate.commands.config.config_args import ClusterConfig
    except ImportError:
        return {}
    return {f.name: f.default for f in dataclasses.fields(ClusterConfig) if f.default is not dataclasses.MISSING}


def read_accelerate(data: dict[str, Any], reading: Reading, file: str) -> None:
    engine = str(data.get("distributed_type", "NO")).upper()
    if engine not in ENGINES:
        raise InputError(f"{file}: distributed_type={engine} is not one anatomist models; known: {', '.join(ENGINES)}")
    if isinstance(data.get("parallelism_config"), dict):  # the parallelism, before a key of its sections it names
        _parallelism(data["parallelism_config"], file)
    _check_keys(data, file)
    defaults = cluster_defaults()
    for key, value in data.items():
        if key == "parallelism_config":
            reading.skip(key, _sizes(value, reading, file), {})
        elif key == "mixed_precision":
            _precision(value, data.get("fp8_config") or {}, reading, file)
        elif key == "fp8_config" and str(data.get("mixed_precision", "")).lower() == "fp8" and isinstance(value, dict):
            _fp8_config(value, reading, file)
        elif key == "num_processes":
            if isinstance(value, int) and value > 0:  # -1: accelerate counts the devices
                reading.set("num_gpus", value, file, key)
        elif key == "deepspeed_config" and engine == "DEEPSPEED":
            _deepspeed(value or {}, reading, file)
        elif key == "fsdp_config" and engine == "FSDP":
            _fsdp(value or {}, reading, file)
        elif key == "dynamo_config":
            _dynamo(value or {}, reading, file)
        elif key == "num_machines":
            if value == 1:
                reading.skip(key, value, 1)
            else:  # a bad value is said by RecipeFile's check of nodes
                reading.set("nodes", value, file, key)
        elif key in MULTI_NODE:  # where the nodes meet: nothing the prediction reads
            reading.skip(key, None)
        elif key != "distributed_type":
            reading.skip(key, value, WRITTEN_BY_DEFAULT.get(key, defaults.get(key)))
    if engine == "DEEPSPEED" and "zero_stage" not in reading.values:
        raise InputError(f"{file}: distributed_type DEEPSPEED needs deepspeed_config.zero_stage "
                         "(or deepspeed_config.deepspeed_config_file)")
    if engine == "FSDP" and "fsdp" not in reading.values:
        reading.set("fsdp", "full_shard", file, "distributed_type")  # accelerate's default strategy
    if engine == "FSDP" and (reading.get("tp_size") or 1) > 1:
        raise InputError(TP_UNDER_ACCELERATE_FSDP.format(file=file, tp=reading.get("tp_size")))


def _precision(value: Any, fp8_config: dict[str, Any], reading: Reading, file: str) -> None:
    """The autocast; "fp8" is bf16 autocast with torchao's float8 layers (accelerate's AO backend, which it also picks
    where fp8_config names none and torchao is installed), in AORecipeKwargs' default recipe, tensorwise."""
    value = str(value).lower()
    if value not in ("no", "fp16", "bf16", "fp8"):
        raise InputError(f"{file}: mixed_precision={value!r} is not modelled; known: no, fp16, bf16, fp8")
    reading.set("fp16", value == "fp16", file, "mixed_precision")
    reading.set("bf16", value in ("bf16", "fp8"), file, "mixed_precision")
    if value == "fp8":
        backend = str(fp8_config.get("backend", fp8_config.get("fp8_backend", "AO"))).upper()
        if backend not in ("AO", "NO"):
            raise InputError(f"{file}: fp8_config.backend={backend} is not modelled (Transformer Engine's and MS-AMP's "
                             "FP8 layers); backend AO (torchao's float8 training) is")
        reading.set("fp8", "tensorwise", file, "mixed_precision")


def _fp8_config(section: dict[str, Any], reading: Reading, file: str) -> None:
    """The AO backend's settings (`accelerate launch --fp8_*`, read by AORecipeKwargs): the float8 all-gather; padded
    inner dimensions are what the trace runs (accelerate's default). The backend is read with mixed_precision."""
    for key, value in section.items():
        if key == "enable_fsdp_float8_all_gather":
            reading.set("fp8_all_gather", bool(value), file, f"fp8_config.{key}")
        elif key == "pad_inner_dim":
            reading.skip(f"fp8_config.{key}", value, True)
        elif key not in ("backend", "fp8_backend"):
            reading.skip(f"fp8_config.{key}", value)


def _deepspeed(section: dict[str, Any], reading: Reading, file: str) -> None:
    prefix = "deepspeed_config"
    if section.get("deepspeed_config_file"):
        path = referenced_file(section["deepspeed_config_file"], file, f"{prefix}.deepspeed_config_file")
        read_deepspeed(load_mapping(path, "DeepSpeed config"), reading, str(path))
    if "zero_stage" in section:
        stage = section["zero_stage"]
        if stage not in (0, 1, 2, 3):
            raise InputError(f"{file}: {prefix}.zero_stage must be 0, 1, 2 or 3, got {stage!r}")
        reading.set("zero_stage", stage, file, f"{prefix}.zero_stage")
        keys = (f"{prefix}.offload_optimizer_device", f"{prefix}.offload_param_device")
        offload = zero_offload(stage, section.get("offload_optimizer_device"), section.get("offload_param_device"),
                               file, keys)
        reading.set("offload", offload, file, keys[0])
    for key, name in (("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("gradient_clipping", "max_grad_norm")):
        if key in section and section[key] != "auto":
            reading.set(name, section[key], file, f"{prefix}.{key}")
    reading.skip_all(prefix, section, keep=("deepspeed_config_file", "zero_stage", "offload_optimizer_device",
                                            "offload_param_device", "gradient_accumulation_steps", "gradient_clipping"))


def _fsdp(section: dict[str, Any], reading: Reading, file: str) -> None:
    """FSDP1 names its strategy (fsdp_sharding_strategy, or fsdp_reshard_after_forward since accelerate 1.6);
    FSDP2 says it with fsdp_reshard_after_forward: True (the default) is full_shard."""
    prefix = "fsdp_config"
    version = section.get("fsdp_version", 1)
    try:  # accelerate launch puts it in FSDP_VERSION, which its plugin reads with int(); any but 2 runs FSDP1
        int(str(version))
    except ValueError:
        raise InputError(f"{file}: {prefix}.fsdp_version must be a whole number (accelerate reads it with int()), "
                         f"got {version!r}") from None
    for key in ("fsdp_reshard_after_forward", "fsdp_sharding_strategy"):
        if key in section:
            reading.set("fsdp", fsdp_mode(section[key], file, f"{prefix}.{key}"), file, f"{prefix}.{key}")
            break
    else:
        reading.set("fsdp", "full_shard", file, f"{prefix}.fsdp_version")  # both versions' default
    fsdp_offload(reading, section.get("fsdp_offload_params"), file, f"{prefix}.fsdp_offload_params")
    refuse_unmodelled("activation_offload", file, f"{prefix}.fsdp_activation_checkpointing_offload",
                      section.get("fsdp_activation_checkpointing_offload"))
    refuse_unmodelled("fsdp_ignored_modules", file, f"{prefix}.fsdp_ignored_modules",
                      section.get("fsdp_ignored_modules"), size=False)
    if section.get("fsdp_activation_checkpointing"):
        reading.set("gradient_checkpointing", True, file, f"{prefix}.fsdp_activation_checkpointing")
    reading.skip_all(prefix, section, keep=("fsdp_version", "fsdp_reshard_after_forward", "fsdp_sharding_strategy",
                                            "fsdp_activation_checkpointing", "fsdp_offload_params"))


def _dynamo(section: dict[str, Any], reading: Reading, file: str) -> None:
    backend = str(section.get("dynamo_backend", "NO")).upper()
    if backend == "INDUCTOR":
        reading.set("torch_compile", True, file, "dynamo_config.dynamo_backend")
    elif backend != "NO":
        reading.skip("dynamo_config.dynamo_backend", backend)  # anatomist models inductor only
    reading.skip_all("dynamo_config", section, keep=("dynamo_backend",))
