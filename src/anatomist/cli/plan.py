"""`anatomist plan`: the fastest recipe that fits, the Pareto front, and why; optionally written out."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING, Any

from rich.table import Table

from anatomist.axes.optimizers import DEFAULT_SEARCH, OPTIMIZERS
from anatomist.axes.precisions import FULL_PRECISIONS, precision_of
from anatomist.axes.shardings import SHARDING_NAMES, sharding_of
from anatomist.cli.common import (
    add_cache_flag,
    add_calibration_flag,
    add_devices_flags,
    add_margin_flag,
    add_model_flags,
    apply_cache_flag,
    calibration_from_args,
    devices_from_args,
    print_json,
    refuse_cce_before_ampere,
    tracing_progress,
    warn,
)
from anatomist.cli.recipe_flags import recipe_file_from_args
from anatomist.cli.render import console, devices, gib
from anatomist.errors import InputError
from anatomist.hardware import get_gpu
from anatomist.plan.emit import TARGETS, launch_commands, launch_warnings, write
from anatomist.plan.emit import render as render_emit
from anatomist.plan.space import SearchSpace, method_of
from anatomist.recipe import TRAINERS, Recipe
from anatomist.workload import load_workload

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
    p.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                   help="samples per optimizer step over all GPUs (default: any batch, no accumulation)")
    add_devices_flags(p, "data-parallel GPUs (adds ZeRO 1/2/3 and FSDP; default: the --recipe file's, else 1)")
    p.add_argument("--max-nodes", type=int, default=None, metavar="N",
                   help="choose the cluster: plan 1, 2, 4 ... --gpus GPUs on one node (default 8), then 2 ... N whole "
                        "nodes, and pick the size with the most samples/s per GPU")
    p.add_argument("--objective", choices=["throughput", "memory"], default="throughput")
    add_margin_flag(p)
    p.add_argument("--optims", default=",".join(DEFAULT_SEARCH), metavar="A,B",
                   help=f"optimizers to search (default {','.join(DEFAULT_SEARCH)}; known: {', '.join(OPTIMIZERS)})")
    p.add_argument("--precisions", default=None, metavar="A,B",
                   help=f"precisions to search (default: all the GPU supports; known: {', '.join(FULL_PRECISIONS)})")
    p.add_argument("--shardings", default=None, metavar="A,B",
                   help=f"sharding options to search where they run (default: all those of the GPU count; known: "
                        f"{', '.join(SHARDING_NAMES)})")
    p.add_argument("--no-compile", action="store_true", help="do not consider torch.compile")
    p.add_argument("--no-liger-kernel", action="store_true",
                   help="do not consider Liger Kernel (searched by default for the causal LMs whose kernels anatomist traces)")
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
    peft.add_argument("--lora-r", type=int, default=None, metavar="N", help="LoRA rank (default 16)")
    peft.add_argument("--lora-alpha", type=int, default=None, metavar="N", help="LoRA alpha (default 32)")
    peft.add_argument("--lora-dropout", type=float, default=None, metavar="P", help="LoRA dropout (default 0)")
    peft.add_argument("--lora-target-modules", default=None, metavar="A,B|all-linear",
                      help="modules to adapt (default: PEFT's for the architecture)")
    p.add_argument("--emit", choices=TARGETS, default=None, help="write the top pick for this library")
    p.add_argument("-o", "--output", metavar="PATH", default=None, help="file for --emit (default: stdout)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON on stdout, nothing else")
    add_calibration_flag(p)
    add_cache_flag(p)
    p.set_defaults(handler=run)


def _names(flag: str, what: str, text: str, known: tuple[str, ...], *, allow_none: bool = False) -> tuple[str, ...]:
    """The comma-separated names of `flag`, each one of `known`."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not (names or allow_none):
        raise InputError(f"{flag}: unknown {what}(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return names


def build_plan(args: argparse.Namespace) -> Plan:
    """The plan the flags ask for (with --max-nodes: the chosen cluster size's, `build_clusters`)."""
    if args.max_nodes is None:
        return _plan(*_search(args))
    chosen = build_clusters(args)[1].plan
    assert chosen is not None  # plan_clusters chooses among the sizes with a plan
    return chosen


def build_clusters(args: argparse.Namespace) -> tuple[list[Cluster], Cluster]:
    """--max-nodes: every cluster size planned (`plan.clusters`), and the chosen one."""
    from anatomist.plan.clusters import cluster_sizes, plan_clusters

    if args.nodes is not None:
        raise InputError("--max-nodes chooses the number of nodes: leave --nodes out")
    sizes = cluster_sizes(args.gpus if args.gpus is not None else 8, args.max_nodes)
    workload, gpu, space, objective, margin, time_model = _search(args, one_size=True)
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


def _search(args: argparse.Namespace, *, one_size: bool = False) -> tuple[Any, Any, SearchSpace, str, float, Any]:
    """What `plan` is given: the workload, the GPU, the search space (`one_size`: one GPU, its size set later), the
    objective, the margin and the time model."""
    apply_cache_flag(args)
    gpu = get_gpu(args.gpu)
    calibration = calibration_from_args(args, gpu)
    optims = _names("--optims", "optimizer", args.optims, tuple(OPTIMIZERS))
    precisions = None if args.precisions is None else _names("--precisions", "precision", args.precisions, FULL_PRECISIONS)
    shardings = None if args.shardings is None else _names("--shardings", "sharding", args.shardings, SHARDING_NAMES)
    added = _names("--peft", "method", args.peft, ("lora", "qlora"), allow_none=True)
    lora = {k: getattr(args, k) for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
            if getattr(args, k) is not None}
    trainer = {k: getattr(args, k) for k in ("trainer", "precompute_ref_log_probs", "padding_free")
               if getattr(args, k) is not None}
    if trainer.get("padding_free"):
        trainer["attn_implementation"] = "flash_attention_2"  # the attention that takes packed sequences
    if lora and not added:
        raise InputError(f"--{next(iter(lora)).replace('_', '-')} needs --peft lora and/or qlora")
    source = recipe_file_from_args(args)
    fixed = dict(source.fields) if source else {}
    refuse_cce_before_ampere(bool(fixed.get("cut_cross_entropy")), gpu)
    methods = ("full", *dict.fromkeys(added))
    if source and {"peft", "load_in_4bit", "load_in_8bit"} & set(fixed):
        if added:
            raise InputError(f"--peft: {source.path} fixes the fine-tuning method ({method_of(source.recipe)})")
        methods = (method_of(source.recipe),)
    model = args.model if args.model is not None else source.model if source else None
    if model is None:
        raise InputError("plan needs a MODEL (or a --recipe file that names one)")
    seq_len = args.seq_len if args.seq_len is not None else source.seq_len if source else None
    num_gpus, nodes = (1, 1) if one_size else devices_from_args(args, source)
    workload = load_workload(model, seq_len=seq_len, task=args.task,
                             trust_remote_code=args.trust_remote_code, allow_network=args.allow_network,
                             avg_seq_len=args.avg_seq_len, lengths=args.lengths, prompt_len=args.prompt_len)
    space = SearchSpace(
        global_batch_size=args.global_batch_size, num_gpus=num_gpus, nodes=nodes, network=args.network, optims=optims,
        compile_options=(False,) if args.no_compile else (False, True),
        liger_options=(False,) if args.no_liger_kernel else None,
        precisions=precisions, shardings=shardings, methods=methods, base=Recipe(**lora, **trainer), fixed=fixed,
    )
    from anatomist.estimate.communication import predict_time

    time_model = functools.partial(predict_time, calibration=calibration)
    return workload, gpu, space, args.objective, args.memory_margin, time_model


def run(args: argparse.Namespace) -> int:
    if args.output and not args.emit:
        raise InputError(f"-o/--output needs --emit {'|'.join(TARGETS)}")
    clusters: list[Cluster] = []
    with tracing_progress():
        if args.max_nodes is not None:
            clusters, chosen = build_clusters(args)
            result = chosen.plan
            assert result is not None  # the chosen size has a plan
        else:
            result = build_plan(args)
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


def _describe(recipe: Recipe, num_gpus: int, liger: bool = False) -> list[str]:
    """The table's cells of `recipe`; `liger`: with the Liger column (when the plan searched it)."""
    return [
        method_of(recipe),
        f"{recipe.per_device_train_batch_size} x {recipe.gradient_accumulation_steps}",
        recipe.checkpointing,
        precision_of(recipe),
        recipe.optim,
        "on" if recipe.torch_compile else "off",
        sharding_of(recipe, num_gpus),
    ] + (["on" if recipe.use_liger_kernel else "off"] if liger else [])


def render_clusters(clusters: list[Cluster], chosen: Plan) -> None:
    """The cluster sizes planned (--max-nodes), the chosen one marked."""
    out = console()
    if not out.is_terminal:
        out.width = 150
    table = Table(title="cluster sizes (the most samples/s per GPU is chosen; its plan follows)", title_justify="left")
    for col in ("GPUs", "nodes", "samples/s", "per GPU", "device memory", "pick"):
        table.add_column(col, justify="left" if col == "pick" else "right")
    for c in clusters:
        if c.best is None:
            table.add_row(str(c.num_gpus), str(c.nodes), "-", "-", "-", f"[dim]{c.why_not}[/]")
            continue
        mark = "[bold green]" if c.plan is chosen else ""
        method, batch, ckpt, precision, optim, compiled, sharding = _describe(c.best.recipe, c.num_gpus)
        pick = f"{method}, {batch}, ckpt {ckpt}, {precision}, {optim}, compile {compiled}, {sharding}"
        cells = [str(c.num_gpus), str(c.nodes), f"{c.best.samples_per_second:.1f}", f"{c.samples_per_gpu:.2f}",
                 gib(c.best.device_total), pick]
        table.add_row(*[f"{mark}{x}" for x in cells])
    out.print(table)


def render(result: Plan) -> None:
    out = console()
    if not out.is_terminal:
        out.width = 150  # piped: do not wrap the table at 80 columns
    w, gpu = result.workload, result.gpu
    gb = result.space.global_batch_size
    out.print(
        f"[bold]{w.name}[/] seq {w.seq_len} on {devices(result.space.num_gpus, result.space.nodes)} x [bold]{gpu.name}[/] "
        f"({gib(gpu.memory_bytes)}), global batch {gb if gb else 'any'}, objective {result.objective}: "
        f"{len(result.candidates)} candidates, {len(result.feasible)} fit"
    )
    table = Table(title="Pareto front (throughput vs peak device memory)", title_justify="left")
    liger = len(result.space.liger_options or ()) > 1
    for col in ("method", "batch x accum", "ckpt", "precision", "optim", "compile", "sharding") + (("liger",) if liger else ()):
        table.add_column(col)
    table.add_column("device memory", justify="right")
    table.add_column("samples/s", justify="right")
    for c in result.pareto:
        mark = "[bold green]" if c is result.best else ""
        cells = _describe(c.recipe, result.space.num_gpus, liger) + [gib(c.device_total), f"{c.samples_per_second:.1f}"]
        table.add_row(*[f"{mark}{x}" for x in cells])
    out.print(table)
    best = result.best
    method, batch, ckpt, precision, optim, compiled, sharding = _describe(best.recipe, result.space.num_gpus)
    adapters = f" (r={best.recipe.lora_r})" if method != "full" else ""
    kernels = ", Liger Kernel" if best.recipe.use_liger_kernel else ""
    out.print(
        f"[bold]top pick[/]: {method} fine-tuning{adapters}, batch {batch}, checkpointing {ckpt}, {precision}, "
        f"{optim}{kernels}, compile {compiled}, "
        f"sharding {sharding}, attention {best.recipe.attn_implementation}: {gib(best.device_total)} of limit "
        f"{gib(result.limit_bytes)}, {best.samples_per_second:.1f} samples/s predicted"
    )
    for reason in best.reasons:
        out.print(f"  - {reason}")
    for note in result.notes:
        out.print(f"  * {note}")
