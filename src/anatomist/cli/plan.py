"""`anatomist plan`: the fastest recipe that fits, the Pareto front, and why; optionally written out."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING, Any

from anatomist.axes.methods import TRAINERS
from anatomist.axes.optimizers import DEFAULT_SEARCH, OPTIMIZERS
from anatomist.axes.precisions import FULL_PRECISIONS
from anatomist.axes.shardings import SHARDING_NAMES
from anatomist.cli.common import (
    add_cache_flag,
    add_calibration_flag,
    add_devices_flags,
    add_margin_flag,
    add_model_flags,
    apply_cache_flag,
    print_json,
    read_recipe_source,
    tracing_progress,
    warn,
    whole_number,
)
from anatomist.cli.render import Column, console, devices, gib, print_table
from anatomist.cli.requests import PlanRequest, plan_request
from anatomist.errors import InputError
from anatomist.hardware import get_gpu
from anatomist.plan.caveats import launch_warnings
from anatomist.plan.emit import TARGETS, launch_commands, write
from anatomist.plan.emit import render as render_emit
from anatomist.plan.space import SearchSpace, method_of
from anatomist.recipe import Recipe
from anatomist.recipe.checks import check_cce_gpu
from anatomist.recipe_labels import differing, shared, summary
from anatomist.workload_loader import load_workload

if TYPE_CHECKING:
    from anatomist.plan.candidates import Candidate
    from anatomist.plan.clusters import Cluster
    from anatomist.plan.search import Plan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search recipes: the fastest that fits, the Pareto front, and why")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="catalog name, Hub id in the local cache, or path (default: the --recipe file's)")
    add_model_flags(p, model_required=False)
    p.add_argument("--recipe", metavar="FILE",
                   help="a recipe file as `estimate --recipe` reads it (TrainingArguments, TRL, accelerate, DeepSpeed, "
                        "axolotl, LLaMA-Factory): the fields it sets are held fixed, the rest searched")
    p.add_argument("--gpu", required=True, metavar="NAME", help="target GPU (see `anatomist gpus`)")
    p.add_argument("--global-batch-size", type=whole_number, default=None, metavar="N",
                   help="samples per optimizer step over all GPUs (default: any batch, no accumulation)")
    add_devices_flags(p, "data-parallel GPUs (adds ZeRO 1/2/3 and FSDP; default: the --recipe file's, else 1)")
    p.add_argument("--max-nodes", type=whole_number, default=None, metavar="N",
                   help="choose the cluster: plan 1, 2, 4 ... --gpus GPUs on one node (default 8), then 2 ... N whole "
                        "nodes, and pick the size with the most samples/s per GPU")
    search = p.add_argument_group("what the plan searches")
    search.add_argument("--objective", choices=["throughput", "memory"], default="throughput",
                        help="the top pick: the fastest that fits (throughput, default) or the smallest (memory)")
    add_margin_flag(p)
    search.add_argument("--optims", default=",".join(DEFAULT_SEARCH), metavar="A,B",
                        help=f"optimizers to search (default {','.join(DEFAULT_SEARCH)}; known: {', '.join(OPTIMIZERS)})")
    search.add_argument("--precisions", default=None, metavar="A,B",
                        help=f"precisions to search (default: all the GPU supports; known: {', '.join(FULL_PRECISIONS)})")
    search.add_argument("--shardings", default=None, metavar="A,B",
                        help=f"sharding options to search where they run (default: all those of the GPU count; known: "
                             f"{', '.join(SHARDING_NAMES)})")
    search.add_argument("--no-compile", action="store_true", help="do not consider torch.compile")
    search.add_argument("--no-liger-kernel", action="store_true",
                        help="do not consider Liger Kernel (searched by default for the causal LMs whose kernels "
                             "anatomist traces)")
    search.add_argument("--no-tensor-parallel", action="store_true",
                        help="do not try tensor parallel or expert parallel (tried on more GPUs than one where the "
                             "recipes without them do not fit, for models with a tp_plan, and for a Mixture of "
                             "Experts with an ep_plan; only --emit trainer writes them)")
    llm = p.add_argument_group("the trainer (kept as given, not searched)")
    llm.add_argument("--trainer", choices=TRAINERS, default=None,
                     help="transformers' Trainer (default), TRL's SFTTrainer (sft) or DPOTrainer (dpo)")
    llm.add_argument("--precompute-ref-log-probs", action="store_true", default=None,
                     help="DPO: reference log-probabilities computed before training (no reference model held)")
    llm.add_argument("--padding-free", action="store_true", default=None,
                     help="SFT: padding-free micro-batches (needs the data's lengths; flash_attention_2 searched only)")
    peft = p.add_argument_group("parameter-efficient fine-tuning (searched only when asked: it changes what is trained)")
    peft.add_argument("--peft", default="", metavar="lora,qlora",
                      help="also search LoRA adapters (bf16/fp32 base) and/or QLoRA (4-bit NF4 base)")
    peft.add_argument("--lora-r", type=whole_number, default=None, metavar="N", help="LoRA rank (default 16)")
    peft.add_argument("--lora-alpha", type=whole_number, default=None, metavar="N", help="LoRA alpha (default 32)")
    peft.add_argument("--lora-dropout", type=float, default=None, metavar="P", help="LoRA dropout (default 0)")
    peft.add_argument("--lora-target-modules", default=None, metavar="A,B|all-linear",
                      help="modules to adapt (default: PEFT's for the architecture)")
    p.add_argument("--emit", choices=TARGETS, default=None, help="write the top pick for this library")
    p.add_argument("-o", "--output", metavar="PATH", default=None, help="file for --emit (default: stdout)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON on stdout, nothing else")
    add_calibration_flag(p)
    add_cache_flag(p)
    p.set_defaults(handler=run)


def _names(flag: str, what: str, names: tuple[str, ...], known: tuple[str, ...], *, allow_none: bool = False) -> tuple[str, ...]:
    """`names` (given to `flag`), each one of `known`."""
    unknown = [n for n in names if n not in known]
    if unknown or not (names or allow_none):
        raise InputError(f"{flag}: unknown {what}(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return names


def build_plan(request: PlanRequest) -> Plan:
    """The plan `request` asks for (with max_nodes: the chosen cluster size's, `build_clusters`): the CLI's and the
    page's."""
    if request.max_nodes is None:
        return _plan(*_search(request))
    chosen = build_clusters(request)[1].plan
    assert chosen is not None  # plan_clusters chooses among the sizes with a plan
    return chosen


def build_clusters(request: PlanRequest) -> tuple[list[Cluster], Cluster]:
    """--max-nodes: every cluster size planned (`plan.clusters`), and the chosen one."""
    from anatomist.plan.clusters import cluster_sizes, plan_clusters

    assert request.max_nodes is not None  # what asks for clusters
    if request.devices.nodes is not None:
        raise InputError("--max-nodes chooses the number of nodes: leave --nodes out")
    sizes = cluster_sizes(request.devices.gpus if request.devices.gpus is not None else 8, request.max_nodes)
    workload, gpu, space, objective, margin, time_model = _search(request, one_size=True)
    progress = console(stderr=True)
    return plan_clusters(space, sizes, lambda sized: _plan(workload, gpu, sized, objective, margin, time_model),
                         lambda sized: _best(workload, gpu, sized, objective, margin, time_model),
                         on_size=lambda g, n: progress.print(f"planning {devices(g, n)} x {gpu.name}"))


def _best(workload: Any, gpu: Any, space: SearchSpace, objective: str, margin: float, time_model: Any) -> Candidate:
    from anatomist.plan.search import fastest_fitting  # imports torch

    return fastest_fitting(workload, gpu, space=space, objective=objective, margin=margin,  # type: ignore[arg-type]
                           time_model=time_model)


def _plan(workload: Any, gpu: Any, space: SearchSpace, objective: str, margin: float, time_model: Any) -> Plan:
    from anatomist.plan.search import plan  # imports torch

    return plan(workload, gpu, space=space, objective=objective, margin=margin,  # type: ignore[arg-type]
                time_model=time_model)


def _searched(request: PlanRequest) -> tuple[tuple[str, ...], tuple[str, ...] | None, tuple[str, ...] | None,
                                             tuple[str, ...]]:
    """The optimizers, precisions (None: all), shardings (None: all) and PEFT methods searched, each name checked."""
    optims = _names("--optims", "optimizer", request.optims, tuple(OPTIMIZERS))
    precisions = None if request.precisions is None else _names("--precisions", "precision", request.precisions,
                                                                 FULL_PRECISIONS)
    shardings = None if request.shardings is None else _names("--shardings", "sharding", request.shardings,
                                                               SHARDING_NAMES)
    return optims, precisions, shardings, _names("--peft", "method", request.peft, ("lora", "qlora"), allow_none=True)


SPLITS_THE_PLAN_TRIES = {"tp_size": "a tensor parallel", "ep_size": "an expert parallel", "cp_size": "a context parallel",
                         "sp_size": "a sequence parallel"}
"""The splits the plan searches itself (plan/splits.py), which a --recipe file cannot hold fixed."""


def _search(request: PlanRequest, *, one_size: bool = False) -> tuple[Any, Any, SearchSpace, str, float, Any]:
    """What `plan` is given: the workload, the GPU, the search space (`one_size`: one GPU, its size set later), the
    objective, the margin and the time model."""
    from anatomist.calibration.lookup import calibration_for

    apply_cache_flag(request.no_cache)
    gpu = get_gpu(request.gpu)
    calibration = calibration_for(gpu, request.calibration)
    optims, precisions, shardings, added = _searched(request)
    lora, trainer = dict(request.lora), dict(request.trainer)
    if trainer.get("padding_free"):
        trainer["attn_implementation"] = "flash_attention_2"  # the attention that takes packed sequences
    if lora and not added:
        raise InputError(f"--{next(iter(lora)).replace('_', '-')} needs --peft lora and/or qlora")
    source = read_recipe_source(request.recipe_file)
    fixed = dict(source.fields) if source else {}
    for field, split in SPLITS_THE_PLAN_TRIES.items():
        if fixed.get(field, 1) > 1:
            raise InputError(f"{source.path if source else 'the recipe'}: plan does not hold {split} size fixed yet "
                             f"({field}={fixed[field]}); it tries it itself where it could help: drop the size from "
                             "the file, or estimate it with `anatomist estimate --recipe`")
    check_cce_gpu(bool(fixed.get("cut_cross_entropy")), gpu)
    methods = ("full", *dict.fromkeys(added))
    if source and {"peft", "load_in_4bit", "load_in_8bit"} & set(fixed):
        if added:
            raise InputError(f"--peft: {source.path} fixes the fine-tuning method ({method_of(source.recipe)})")
        methods = (method_of(source.recipe),)
    asked = request.model
    model = asked.model if asked.model is not None else source.model if source else None
    if model is None:
        raise InputError("plan needs a MODEL (or a --recipe file that names one)")
    seq_len = asked.seq_len if asked.seq_len is not None else source.seq_len if source else None
    num_gpus, nodes = (1, 1) if one_size else request.devices.counted(source)
    replicas, strategy = fixed.get("dp_replicate_size", 1), fixed.get("fsdp", "full_shard")
    if replicas > 1 and (replicas != nodes or strategy != "full_shard"):
        under = f" under {strategy}" if strategy != "full_shard" else ""
        raise InputError(f"{source.path if source else 'the recipe'}: plan searches hybrid sharding as one replica of "
                         f"FULL_SHARD per node (hsdp); this file has {replicas} replicas on {nodes} node(s){under}: "
                         "estimate it with `anatomist estimate --recipe`")
    workload = load_workload(model, seq_len=seq_len, task=asked.task,
                             trust_remote_code=asked.trust_remote_code, allow_network=asked.allow_network,
                             avg_seq_len=asked.avg_seq_len, lengths=asked.lengths, prompt_len=asked.prompt_len)
    space = SearchSpace(
        global_batch_size=request.global_batch_size, num_gpus=num_gpus, nodes=nodes, network=request.devices.network,
        optims=optims, compile_options=(False,) if request.no_compile else (False, True),
        liger_options=(False,) if request.no_liger_kernel else None, tensor_parallel=not request.no_tensor_parallel,
        precisions=precisions, shardings=shardings, methods=methods, base=Recipe(**lora, **trainer), fixed=fixed,
    )
    from anatomist.estimate.time.cluster import predict_time

    time_model = functools.partial(predict_time, calibration=calibration)
    return workload, gpu, space, request.objective, request.memory_margin, time_model


def run(args: argparse.Namespace) -> int:
    if args.output and not args.emit:
        raise InputError(f"-o/--output needs --emit {'|'.join(TARGETS)}")
    request = plan_request(args)
    clusters: list[Cluster] = []
    with tracing_progress():
        if request.max_nodes is not None:
            clusters, chosen = build_clusters(request)
            result = chosen.plan
            assert result is not None  # the chosen size has a plan
        else:
            result = build_plan(request)
    if args.emit:
        for warning in launch_warnings(result.best.recipe, args.emit):
            warn(warning)
    if args.emit and args.output:
        space = result.space
        written = write(result.best.recipe, args.emit, args.output, space.num_gpus, model=result.workload.repo_id,
                        task=result.workload.task, seq_len=result.workload.seq_len, nodes=space.nodes,
                        prompt_len=result.workload.prompt_len)
        print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
        commands = launch_commands(result.best.recipe, args.emit, args.output, space.num_gpus, space.nodes)
        for rank, command in enumerate(commands):
            print(f"{'run' if space.nodes == 1 else f'node {rank}'}: {command}", file=sys.stderr)
    if args.json:
        print_json(result.to_dict() | ({"clusters": [c.to_dict() for c in clusters]} if clusters else {}))
    elif args.emit and not args.output:
        sys.stdout.write(render_emit(result.best.recipe, args.emit, result.space.num_gpus,
                                     model=result.workload.repo_id, seq_len=result.workload.seq_len,
                                     nodes=result.space.nodes, prompt_len=result.workload.prompt_len))
    else:
        if clusters:
            render_clusters(clusters, result)
        render(result)
    return 0


def render_clusters(clusters: list[Cluster], chosen: Plan) -> None:
    """The cluster sizes planned (--max-nodes), the chosen one marked; each size's pick named by the settings in
    which the picks differ, what they share said once under the table."""
    picked = [c for c in clusters if c.best is not None]
    recipes, sizes = [c.best.recipe for c in picked if c.best], [c.num_gpus for c in picked]
    facets = differing(recipes, sizes)
    columns = [Column(name=n, right=True) for n in ("GPUs", "nodes", "samples/s", "per GPU", "device memory")]
    rows, marked = [], []
    for c in clusters:
        if c.best is None:
            rows.append([str(c.num_gpus), str(c.nodes), "-", "-", "-", c.why_not or ""])
            continue
        if c.plan is chosen:
            marked.append(len(rows))
        rows.append([str(c.num_gpus), str(c.nodes), f"{c.best.samples_per_second:.1f}", f"{c.samples_per_gpu:.2f}",
                     gib(c.best.device_total), summary(c.best.recipe, c.num_gpus, facets)])
    common = shared(recipes, sizes)
    print_table(console(), "cluster sizes (the most samples/s per GPU is chosen; its plan follows)",
                [*columns, Column(name="pick")], rows, marked=marked,
                caption=f"every pick: {common}" if common else None)


def render(result: Plan) -> None:
    out = console()
    w, gpu = result.workload, result.gpu
    gb = result.space.global_batch_size
    n = result.space.num_gpus
    out.print(
        f"[bold]{w.name}[/] seq {w.seq_len} on {devices(n, result.space.nodes)} x [bold]{gpu.name}[/] "
        f"({gib(gpu.memory_bytes)}), global batch {gb if gb else 'any'}, objective {result.objective}: "
        f"{len(result.candidates)} candidates, {len(result.feasible)} fit"
    )
    # the columns: what differs among the front's recipes (and the batch); the rest is the same for all, said below
    facets = differing([c.recipe for c in result.pareto], n)
    rows = [[f.value(c.recipe, n) for f in facets] + [gib(c.device_total), f"{c.samples_per_second:.1f}"]
            for c in result.pareto]
    columns = [Column(name=f.header) for f in facets] + [Column(name="device memory", right=True),
                                                         Column(name="samples/s", right=True)]
    marked = [i for i, c in enumerate(result.pareto) if c is result.best]
    common = shared([c.recipe for c in result.pareto], n)
    print_table(out, "Pareto front (throughput vs peak device memory)", columns, rows, marked=marked,
                caption=f"every recipe above: {common}" if common else None)
    best = result.best
    method, rest = summary(best.recipe, n).split(", ", 1)
    adapters = f" (r={best.recipe.lora_r})" if best.recipe.peft != "none" else ""
    out.print(
        f"[bold]top pick[/]: {method}{adapters}, {rest}: {gib(best.device_total)} of limit "
        f"{gib(result.limit_bytes)}, {best.samples_per_second:.1f} samples/s predicted"
    )
    for reason in best.reasons:
        out.print(f"  - {reason}", markup=False)
    for note in result.notes:
        out.print(f"  * {note}", markup=False)
