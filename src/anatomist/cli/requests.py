"""What `anatomist estimate`, `check` and `plan` are asked, as frozen requests.

The command line is read into a request here (`estimate_request`, `check_request`, `plan_request`); the page
builds the same request from its form (`web.form`). Both hand it to the same functions
(`cli.estimate.build_estimate`, `cli.plan.build_plan`), which resolve it: the GPU, the recipe file, the
defaults and the checks are settled there, in one order, with one set of messages. A request holds what was
given and nothing resolved: a value left out is None (or the flag's own default), never a placeholder.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.axes.optimizers import DEFAULT_SEARCH
from anatomist.cli.recipe_flags import given_flags
from anatomist.errors import InputError

if TYPE_CHECKING:
    from anatomist.recipe.files import RecipeFile
    from anatomist.workload import Task

LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
"""The LoRA settings `plan` takes (its --peft methods are searched, these held)."""
TRAINER_FIELDS = ("trainer", "precompute_ref_log_probs", "padding_free")
"""The trainer settings `plan` keeps as given (not searched)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRequest:
    """MODEL and the shape of its samples, as `workload_loader.load_workload` takes them."""

    model: str | None = None
    """A catalog name, Hub id or path; None: the --recipe file's, else the command's default."""
    seq_len: int | None = None
    """Tokens per sample (None: the recipe file's, else 512 or the model's maximum)."""
    task: Task | None = None
    """The head trained (None: the model's default)."""
    trust_remote_code: bool = False
    allow_network: bool = False
    avg_seq_len: int | None = None
    """The data's mean tokens per example."""
    lengths: str | None = None
    """A file of the data's token counts (instead of `avg_seq_len`)."""
    prompt_len: int | None = None
    """DPO: tokens of each prompt, which the loss does not score."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicesRequest:
    """The GPUs a recipe runs on, as given (`common.devices_from_request` settles them)."""

    gpus: int | None = None
    """GPUs on each node (None: the recipe file's, else 1)."""
    nodes: int | None = None
    """Machines the GPUs are spread over (None: the recipe file's, else 1)."""
    network: str | None = None
    """The network between the nodes (None: the default one)."""

    def counted(self, source: RecipeFile | None) -> tuple[int, int]:
        """(GPUs in all, nodes): --gpus per node times --nodes, else the --recipe file's (`source`: a RecipeFile's
        num_gpus counts every node's devices, as accelerate's num_processes does), else one GPU on one node.

        Raises:
            InputError: --gpus below 1, --nodes without --gpus, a cluster the network model refuses.
        """
        from anatomist.estimate.time.network import check_cluster

        nodes = self.nodes if self.nodes is not None else (source.nodes if source and source.nodes else 1)
        if self.gpus is not None:
            if self.gpus <= 0:
                raise InputError(f"--gpus must be greater than 0, got {self.gpus}")
            num_gpus = self.gpus * nodes
        elif source and source.num_gpus:
            num_gpus = source.num_gpus
        elif nodes > 1:
            raise InputError("--nodes needs --gpus, the GPUs of one node")
        else:
            num_gpus = 1
        check_cluster(num_gpus, nodes, self.network)
        return num_gpus, nodes


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimateRequest:
    """`anatomist estimate`: one recipe on one model and GPU."""

    model: ModelRequest
    gpu: str
    """The GPU's name as given (a catalog name, an alias, or "local")."""
    devices: DevicesRequest = DevicesRequest()
    recipe_file: str | None = None
    """--recipe: a recipe file, whose fields the `recipe` ones override."""
    recipe: dict[str, Any] = field(default_factory=dict)
    """The Recipe fields given, in the dataclass's order (a flag not given is absent)."""
    mode: Literal["train", "inference"] = "train"
    calibration: str | None = None
    """A time calibration file (None: the user's for the GPU, else the published one)."""
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    no_cache: bool = False
    """Neither read nor write the disk trace cache."""
    longest_seq_len: bool = False
    """Estimate at the longest sequence that fits, searched (`estimate.longest`), instead of `model.seq_len`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckRequest:
    """`anatomist check`: whether the estimate's recipe fits (its GPU "local": the one found here)."""

    estimate: EstimateRequest
    limit_gib: float | None = None
    """A memory budget per device in GiB, instead of the GPU's memory less the margin."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """`anatomist plan`: the recipes searched for one model and GPU, and what is held fixed."""

    model: ModelRequest
    gpu: str
    recipe_file: str | None = None
    """--recipe: a recipe file whose fields are held fixed."""
    global_batch_size: int | None = None
    devices: DevicesRequest = DevicesRequest()
    max_nodes: int | None = None
    """Plan every cluster size up to this many nodes and choose one."""
    objective: str = "throughput"
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    optims: tuple[str, ...] = tuple(DEFAULT_SEARCH)
    """Optimizers searched, as given (checked against the registry when the plan is built)."""
    precisions: tuple[str, ...] | None = None
    """Precisions searched (None: all the GPU supports)."""
    shardings: tuple[str, ...] | None = None
    """Sharding options searched (None: all those of the GPU count)."""
    no_compile: bool = False
    no_liger_kernel: bool = False
    no_tensor_parallel: bool = False
    """Do not try tensor or expert parallel (`SearchSpace.tensor_parallel`): --no-tensor-parallel, or an --emit target
    other than trainer, whose files cannot say them (transformers sets them at load time)."""
    peft: tuple[str, ...] = ()
    """Methods searched beside full fine-tuning: lora and/or qlora."""
    lora: dict[str, Any] = field(default_factory=dict)
    """The LORA_FIELDS given, in that order."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """The TRAINER_FIELDS given, in that order."""
    calibration: str | None = None
    no_cache: bool = False


def model_request(args: argparse.Namespace) -> ModelRequest:
    """MODEL and the data flags (`common.add_model_flags`) of a parsed command line."""
    return ModelRequest(model=args.model, seq_len=args.seq_len, task=args.task, trust_remote_code=args.trust_remote_code,
                        allow_network=args.allow_network, avg_seq_len=args.avg_seq_len, lengths=args.lengths,
                        prompt_len=args.prompt_len)


def devices_request(args: argparse.Namespace) -> DevicesRequest:
    return DevicesRequest(gpus=args.gpus, nodes=args.nodes, network=args.network)


def estimate_request(args: argparse.Namespace) -> EstimateRequest:
    """The request of `anatomist estimate`'s (or `check`'s) flags."""
    return EstimateRequest(model=model_request(args), gpu=args.gpu, devices=devices_request(args),
                           recipe_file=args.recipe, recipe=given_flags(args), mode=args.mode,
                           calibration=getattr(args, "calibration", None), memory_margin=args.memory_margin,
                           no_cache=args.no_cache, longest_seq_len=getattr(args, "longest_seq_len", False))


def check_request(args: argparse.Namespace) -> CheckRequest:
    return CheckRequest(estimate=estimate_request(args), limit_gib=args.limit_gib)


def plan_request(args: argparse.Namespace) -> PlanRequest:
    """The request of `anatomist plan`'s flags; the comma-separated lists split (their names are checked when the
    plan is built, with the flag's name)."""
    return PlanRequest(
        model=model_request(args), gpu=args.gpu, recipe_file=args.recipe, global_batch_size=args.global_batch_size,
        devices=devices_request(args), max_nodes=args.max_nodes, objective=args.objective,
        memory_margin=args.memory_margin, optims=split_names(args.optims),
        precisions=None if args.precisions is None else split_names(args.precisions),
        shardings=None if args.shardings is None else split_names(args.shardings), no_compile=args.no_compile,
        no_liger_kernel=args.no_liger_kernel,
        no_tensor_parallel=args.no_tensor_parallel or args.emit not in (None, "trainer"), peft=split_names(args.peft), lora=_given(args, LORA_FIELDS),
        trainer=_given(args, TRAINER_FIELDS), calibration=args.calibration, no_cache=args.no_cache,
    )


def split_names(text: str) -> tuple[str, ...]:
    """The names of a comma-separated flag value ("a, b," -> ("a", "b"))."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}

