"""`anatomist estimate`: predict where the memory of a training step goes, offline."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from anatomist.anatomy import MemoryCategory, TimeAnatomy
from anatomist.cli.common import (
    add_cache_flag,
    add_calibration_flag,
    add_devices_flags,
    add_margin_flag,
    add_model_flags,
    apply_cache_flag,
    note_missing_packages,
    print_json,
    read_recipe_source,
    tracing_progress,
    warn,
)
from anatomist.cli.recipe_flags import add_recipe_flags
from anatomist.cli.render import Column, console, devices, gib, print_table
from anatomist.cli.requests import EstimateRequest, estimate_request
from anatomist.estimate.moe import MoeRouting
from anatomist.estimate.time.cluster import UNFITTED_TERMS, adds_device_terms
from anatomist.estimate.time.network import describe_network
from anatomist.hardware import GPU, get_gpu
from anatomist.recipe import Recipe
from anatomist.recipe.axis_values import sharding_of
from anatomist.recipe.checks import check_gpu, emulated_bf16_note
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

if TYPE_CHECKING:
    from anatomist.estimate.predict import Estimate
    from anatomist.recipe import ResolvedRecipe

DEFAULT_MODEL = "bert-large-uncased"
DEFAULT_GPU = "V100-16GB"
SEEDS_RECIPE = {"per_device_train_batch_size": 4}
"""What the seeds' experiment names beyond today's defaults (bert-large-uncased, seq 512, V100)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="predict the memory (and time) of one step, offline")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=f"catalog name, Hub id in the local cache, or path (default: the example of the "
                        f"Transformers guide 'Model training anatomy', {DEFAULT_MODEL} at batch "
                        f"{SEEDS_RECIPE['per_device_train_batch_size']})")
    add_model_flags(p, model_required=False)
    add_recipe_flags(p)
    p.add_argument("--gpu", default=DEFAULT_GPU, metavar="NAME", help=f"target GPU (default {DEFAULT_GPU}; 'local' = detected)")
    p.add_argument("--mode", choices=["train", "inference"], default="train")
    p.add_argument("--longest-seq-len", action="store_true",
                   help="estimate at the longest sequence that fits (multiples of 128 tokens up to the model's "
                        "longest), searched at the recipe's batch; --seq-len is then not needed")
    add_devices_flags(p, "devices ZeRO/FSDP shard across (default: the --recipe file's, else 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout, nothing else")
    p.add_argument("--report", metavar="PATH", help="also write an HTML report")
    add_calibration_flag(p)
    add_margin_flag(p)
    add_cache_flag(p)
    # Kept for scripts written against 0.1: a prediction never needs the method's package now.
    p.add_argument("--ignore-missing-packages", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


def build_estimate(request: EstimateRequest) -> Estimate:
    """The estimate `request` asks for: the CLI's and the page's."""
    from anatomist.calibration.lookup import calibration_for

    gpu = get_gpu(request.gpu)
    calibration = calibration_for(gpu, request.calibration)  # a bad calibration file is said before any heavy import
    workload, recipe, gpu, (num_gpus, nodes) = estimate_inputs(request, gpu)
    from anatomist.estimate.predict import estimate  # torch only if something must be traced

    def at(workload: Workload) -> Estimate:
        return estimate(workload, recipe, gpu, mode=request.mode, num_gpus=num_gpus, calibration=calibration,
                        margin=request.memory_margin, nodes=nodes, network=request.devices.network)

    if not request.longest_seq_len:
        return at(workload)
    from anatomist.estimate.longest import longest_sequence
    from anatomist.trace.store.parts import at_length

    found = longest_sequence(workload, recipe, gpu, mode=request.mode, num_gpus=num_gpus, margin=request.memory_margin)
    with found.derivation():
        result = at(at_length(workload, found.tokens or found.step))
    return dataclasses.replace(result, longest=found)


def estimate_inputs(
    request: EstimateRequest, gpu: GPU | None = None
) -> tuple[Workload, ResolvedRecipe, GPU, tuple[int, int]]:
    """The workload, resolved recipe, GPU (`gpu`, else the request's), and devices in all and nodes, that the
    request and its recipe file describe, checked (`anatomist check` asks the same)."""
    apply_cache_flag(request.no_cache)
    gpu = gpu or get_gpu(request.gpu)
    source = read_recipe_source(request.recipe_file)
    asked = request.model
    # What the command line gives wins over what the file says; without MODEL from either: the
    # seeds' experiment, with the batch size the seeds name.
    model = _given(asked.model, source.model if source else None)
    seq_len = _given(asked.seq_len, source.seq_len if source else None)
    devices = request.devices.counted(source)
    # The recipe, then the model: a bad value or a mistyped name is said before anything imports
    # transformers (Recipe's defaults are kept on disk per transformers version).
    base = dict(source.fields) if source is not None else dict(SEEDS_RECIPE if model is None else {})
    recipe = Recipe.from_dict({**base, **request.recipe}, source="flags")
    check_gpu(recipe, gpu)
    workload = load_workload(
        model or DEFAULT_MODEL, seq_len=seq_len, task=asked.task,
        trust_remote_code=asked.trust_remote_code, allow_network=asked.allow_network,
        avg_seq_len=asked.avg_seq_len, lengths=asked.lengths, prompt_len=asked.prompt_len,
    )
    recipe = recipe.resolved(workload)  # refuses what the model cannot take before any note is said
    workload.for_recipe(recipe)  # and what the data cannot (padding-free without its lengths)
    if request.longest_seq_len:
        from anatomist.estimate.longest import check_length_search

        check_length_search(recipe)
    note_missing_packages(recipe)
    emulated = emulated_bf16_note(recipe, gpu, workload.name)
    if emulated:
        warn(emulated)
    return workload, recipe, gpu, devices


def _given(*values: Any) -> Any:
    """The first value that is not None (a flag given, then the recipe file's, then the default)."""
    return next((v for v in values if v is not None), None)


def run(args: argparse.Namespace) -> int:
    with tracing_progress():
        result = build_estimate(estimate_request(args))
        change = what_would_fit(result) if not args.json and result.memory.max_batch_size == 0 else None
    if args.json:
        print_json(result.to_dict())
    else:
        render(result, change)
    if args.report:
        from anatomist.report import write_report  # noqa: PLC0415 - optional until the report exists

        write_report(result.to_dict(), args.report)
    return 0


RULE_SOURCE = ('bytes per parameter of the weights, gradients and optimizer states, the rule of thumb of the '
               'Transformers guide "Model training anatomy"')
"""What the table's rule column is, said once under it (estimate/rules.py has the figures)."""


VERDICT_WORDS = {"fits": ("fits", "green"), "borderline": ("borderline: inside the interval", "yellow"),
                 "does not fit": ("does not fit", "red")}
"""How each verdict (`intervals.Verdict`) is said and coloured."""


def verdict(result: Estimate) -> tuple[str, str]:
    """(the word, its colour) of whether the recipe fits the usable memory at the top of its interval, is
    borderline (the limit inside it) or does not fit: one place to say it, on the terminal and on the page."""
    return VERDICT_WORDS[result.memory.verdict]


def largest_batch(result: Estimate) -> str:
    """The largest per-device batch that fits, or, where none does, that said plainly."""
    n = result.memory.max_batch_size
    return str(n) if n > 0 else "none: even batch 1 does not fit"


def longest_line(result: Estimate) -> str:
    """What `--longest-seq-len` found: the length, what the next one up would take, how it was searched."""
    found = result.longest
    assert found is not None
    batch = result.recipe.per_device_train_batch_size
    limit = f"the model's {found.limit:,}" if found.limit_is_the_models else f"{found.limit:,} (the config sets none)"
    if found.tokens:
        head = f"longest sequence that fits: {found.tokens:,} tokens at batch {batch}"
    else:
        head = f"longest sequence that fits: none, even {found.step:,} tokens at batch {batch} do not"
    above = (f"; {found.next_tokens:,} would take {gib(found.next_device_total)} of {gib(result.memory.limit_bytes)} "
             "usable" if found.next_tokens is not None and found.next_device_total is not None and found.tokens else "")
    traced = " and ".join(f"{n:,}" for n in found.traced) if len(found.traced) <= 2 else \
        ", ".join(f"{n:,}" for n in found.traced)
    if found.derived_from:
        basis = ", ".join(f"{n:,}" for n in found.derived_from)
        how = f"{found.derived} lengths derived from traces at {basis} tokens, the answer checked by direct traces at {traced}"
    else:
        how = f"traced at {traced} ({found.why_traced})"
    return f"{head} (multiples of {found.step:,} up to {limit}{above}); {how}"


def what_would_fit(result: Estimate) -> str:
    """Where even batch 1 does not fit: the smallest change that does, searched as `anatomist check` searches it
    (the batch and accumulation that keep the effective batch, gradient checkpointing, the optimizer), else what
    else to try. Traces what that search needs (seconds); asked only where nothing fits."""
    from anatomist.measure.preflight import SEARCHED_FIELDS, Preflight, smallest_change

    change, changed, _ = smallest_change(result, result.num_gpus, SEARCHED_FIELDS)
    if change is not None:
        found = Preflight(estimate=result, num_gpus=result.num_gpus, change=change, changed=changed)
        return f"smallest change that fits: {found.describe_change()}"
    w = result.workload
    devices = (f" --gpus {result.num_gpus // result.nodes}" + (f" --nodes {result.nodes}" if result.nodes > 1 else "")
               if result.num_gpus > 1 else "")
    plan = f"anatomist plan {w.repo_id or w.name} --gpu {result.gpu.name} --seq-len {w.seq_len}{devices}"
    return (f"no change of batch, accumulation, checkpointing or optimizer fits; LoRA or QLoRA, sharding over more "
            f"GPUs, or a GPU with more memory may: `{plan} --peft lora,qlora` searches the first, the same with more "
            "--gpus the second")


def render(result: Estimate, change: str | None = None) -> None:
    """The estimate as the terminal (or a pipe) shows it; `change`: what would fit where nothing does."""
    out = console()
    mem = result.memory
    a = mem.anatomy
    assert a.device_total is not None and a.peak_reserved is not None  # an estimate has both
    w = result.workload
    out.print(
        f"[bold]{w.name}[/] ({w.task}, {mem.parameters / 1e6:,.1f} M parameters), seq {w.seq_len}, "
        f"batch {result.recipe.per_device_train_batch_size} x {result.recipe.gradient_accumulation_steps} accumulation, "
        f"weights {result.recipe.dtype}{_autocast(result.recipe)}{_peft(result.recipe)}, "
        f"checkpointing {result.recipe.checkpointing}, {_attention(result)}, "
        f"sharding {_sharding(result.recipe, result.num_gpus)}, "
        f"{result.mode} on {devices(result.num_gpus, result.nodes)} x [bold]{result.gpu.name}[/] "
        f"({gib(result.gpu.memory_bytes)})"
    )
    rule = mem.rule
    rule_col = {c: rule.describe(c.value) for c in (MemoryCategory.WEIGHTS, MemoryCategory.OPTIMIZER_STATES,
                                                   MemoryCategory.GRADIENTS)}
    rows = [[c.label, gib(a.category_bytes(c)), f"{a.category_bytes(c) / a.device_total:.0%}", rule_col.get(c, "")]
            for c in MemoryCategory]
    rows.append(["device total (nvidia-smi)", gib(a.device_total), "", ""])
    columns = [Column(name="component"), Column(name="predicted", right=True), Column(name="share", right=True),
               Column(name="bytes/param rule", right=True)]
    print_table(out, "Memory anatomy at the peak", columns, rows, total=True)
    word, colour = verdict(result)
    out.print(
        f"peak in [bold]{a.peak_phase}[/]: allocated {gib(a.peak_allocated)}, reserved {gib(a.peak_reserved)}, "
        f"device {gib(a.device_total)} (likely {gib(mem.interval.low)} to {gib(mem.interval.high)}) of "
        f"{gib(mem.limit_bytes)} usable ({gib(result.gpu.memory_bytes)} less the {result.margin:.0%} margin): "
        f"[{colour}]{word}[/]; largest batch that fits: [bold]{largest_batch(result)}[/]"
    )
    out.print(f"memory interval: {mem.interval.basis}", style=None if mem.interval.validated else "yellow",
              markup=False)
    if result.longest is not None:
        out.print(longest_line(result), markup=False)
    if change:
        out.print(change, markup=False)
    if rule.total_bytes is not None:
        per_param = f"{rule.total_per_param:g} B/param = " if rule.total_per_param is not None else ""
        out.print(f"bytes/param rule: {per_param}{gib(rule.total_bytes)} + activations ({RULE_SOURCE})")
    if result.moe is not None:
        out.print(_moe_line(result.moe))
    for note in mem.notes:
        out.print(f"  - {note}", markup=False)
    if result.time is not None:
        render_time(result.time, several=adds_device_terms(result.recipe, result.num_gpus))
    if result.nodes > 1:
        out.print(describe_network(result.num_gpus, result.nodes, result.network, result.gpu), markup=False)


def render_time(t: TimeAnatomy, *, several: bool = False) -> None:
    """The predicted step time, its split by phase and by operation class; `several`: devices or offload
    add terms the calibration's error does not cover."""
    out = console()
    likely = (f", likely {t.interval.low * 1e3:,.1f} to {t.interval.high * 1e3:,.1f} ms" if t.interval is not None
              else "")
    # HFU: with gradient checkpointing's recomputation
    columns = [Column(name=n, right=True) for n in ("step time", "samples/s", "tokens/s", "TFLOP/s", "MFU", "HFU")]
    row = [f"{t.step_s * 1e3:,.1f} ms{likely}", f"{t.samples_per_second:,.1f}", f"{t.tokens_per_second:,.0f}",
           f"{t.flops_per_step / t.step_s / 1e12:,.1f}", f"{t.mfu:.0%}", f"{t.hfu:.0%}"]
    print_table(out, "Time anatomy of one step (roofline)", columns, [row])
    phases = [f"{k} {v * 1e3:,.1f} ms ({v / t.step_s:.0%})" for k, v in t.phases_s.items()]
    if t.hidden_communication_s:
        phases.append(f"and {t.hidden_communication_s * 1e3:,.1f} ms of collectives hidden behind compute")
    out.print("phases:  " + ", ".join(phases))
    out.print("classes: " + ", ".join(f"{k} {v / t.step_s:.0%}" for k, v in t.classes_s.items()))
    said = f"{t.calibration}; {UNFITTED_TERMS}" if several else t.calibration
    out.print(said if t.calibrated else f"[yellow]{said}[/]")
    if t.interval is not None:
        out.print(f"time interval: {t.interval.basis}", style=None if t.interval.validated else "yellow", markup=False)


def _attention(result: Estimate) -> str:
    """The attention kernel, and why where it is transformers' fallback for a model without SDPA."""
    attention = result.recipe.attn_implementation
    if attention == "eager" and result.workload.default_attention() == "eager":
        return "attention eager (transformers' default: the model has no SDPA)"
    return f"attention {attention}"


def _autocast(recipe: Recipe) -> str:
    """The autocast, and torchao's FP8 layers on top of it."""
    fp8 = f" + fp8 {recipe.fp8} (torchao)" if recipe.fp8 != "none" else ""
    return (f" + {recipe.mixed_precision} autocast" if recipe.mixed_precision != "no" else "") + fp8


def _sharding(recipe: Recipe, num_gpus: int) -> str:
    """The sharding's name (axes/shardings.py), and where ZeRO offloads to."""
    if recipe.tp_size > 1:
        return ("fsdp_full_shard, " if recipe.fsdp != "none" else "") + f"tensor parallel {recipe.tp_size}"
    if recipe.dp_replicate_size > 1:
        replicas = recipe.dp_replicate_size
        name = f"fsdp_{recipe.fsdp}, hybrid: {replicas} replicas x {num_gpus // replicas} shards"
        name += f", context parallel {recipe.cp_size}" if recipe.cp_size > 1 else ""
        return name + (f", offload to {recipe.offload}" if recipe.offload != "none" else "")
    name = sharding_of(recipe, num_gpus).removesuffix("+offload")
    return name + (f", offload to {recipe.offload}" if recipe.offload != "none" else "")


def _peft(recipe: Recipe) -> str:
    if recipe.peft == "none":
        return ""
    base = f"{recipe.bnb_4bit_quant_type} 4-bit base, " if recipe.load_in_4bit else "int8 base, " if recipe.load_in_8bit else ""
    return f", {recipe.peft} ({base}r={recipe.lora_r})"


def _moe_line(moe: MoeRouting) -> str:
    """The peak of a Mixture of Experts from balanced routing to the most a device can be sent."""
    lo, hi = moe.peak_range_bytes
    peak = f"{gib(lo)} allocated, the same" if lo == hi else f"{gib(lo)} to {gib(hi)} allocated"
    if moe.ep_size > 1:
        balanced, skewed = moe.received_rows_range
        return (f"MoE peak for any routing: {peak} from balanced ({balanced:,} routed rows per GPU and layer) to one "
                f"GPU's experts picked by every token of its {moe.ep_size}-GPU group ({skewed:,})")
    return (f"MoE peak for any routing: {peak} from balanced ({moe.balanced_tokens_per_expert:,.0f} "
            f"tokens per expert) to one expert receiving every token ({moe.max_tokens_per_expert:,})")
