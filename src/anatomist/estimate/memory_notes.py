"""The notes of a memory estimate: what its figures assume and leave out, recipe by recipe."""

from __future__ import annotations

from anatomist.anatomy import GIB, MemoryAnatomy
from anatomist.axes.liger import liger_note, liger_table
from anatomist.estimate.llm_notes import llm_notes
from anatomist.estimate.loss_peak import loss_peak_note
from anatomist.estimate.moe import moe_note
from anatomist.estimate.peft_notes import peft_notes
from anatomist.estimate.rules import BytesPerParamRule
from anatomist.estimate.traces import StepTraces, offloaded_bytes
from anatomist.recipe import ResolvedRecipe
from anatomist.trace.step.fp8 import traced_float8_gather
from anatomist.trace.store.keys import traced_compile
from anatomist.workload import Workload


def memory_notes(workload: Workload, recipe: ResolvedRecipe, anatomy: MemoryAnatomy, rule: BytesPerParamRule,
                 traces: StepTraces) -> list[str]:
    """What the memory estimate says beside its figures: the bytes/param rule's reading, the loss's peak, the
    precision, compile, attention, offload, Liger, LLM, PEFT and MoE notes that apply to `recipe`."""
    notes = [workload.config_note] if workload.config_note else []  # a catalog alias: which config stands in
    notes += rule.explain(anatomy, recipe)
    loss = loss_peak_note(workload, recipe, anatomy, traces)
    if loss is not None:
        notes.append(loss)
    if recipe.peft != "none":
        base = (f"{recipe.bnb_4bit_quant_type} 4-bit" if recipe.load_in_4bit else "int8" if recipe.load_in_8bit
                else recipe.dtype)
        notes.append(f"{recipe.peft}: the {base} base is frozen (no gradients, no optimizer states); the r={recipe.lora_r} "
                     "adapters (fp32, as PEFT makes them) carry the full rule")
    elif recipe.half_weights and recipe.fsdp != "none" and recipe.tp_size == 1 and recipe.mixed_precision != "no":
        notes.append(  # trace/step/fsdp.py does what accelerate's fsdp2_prepare_model does
            f"weights loaded in {recipe.dtype}, but with {recipe.mixed_precision} mixed precision accelerate's FSDP2 "
            "upcasts the trainable parameters to fp32: fp32 sharded master weights, gradients and optimizer states, "
            f"the weights gathered in {recipe.mixed_precision} for compute"
        )
    elif recipe.half_weights:
        notes.append(
            f"weights loaded in {recipe.dtype}: pure {recipe.dtype} training (gradients and optimizer states "
            "in that dtype, no fp32 master weights); --dtype float32 gives the fp32 / mixed-precision figure"
        )
    if recipe.torch_compile:
        notes.append(  # trace/step/compiled.py
            "torch.compile: each block keeps for backward what AOTAutograd's min-cut partitioner (inductor's "
            "partition) saves, traced on fake tensors; inductor's kernels are approximated (its code generation "
            "is not run); embeddings, head and loss stay eager" + ("; with gradient checkpointing the blocks are "
            "predicted as eager checkpointed code (fusion's time saving not counted)" if recipe.gradient_checkpointing else "")
        )
    if recipe.attn_implementation == "flash_attention_2":
        notes.append("flash_attention_2: modelled as a fused kernel keeping output + log-sum-exp (as SDPA flash)")
    if recipe.activation_offloading:
        moved = offloaded_bytes(traces, recipe.per_device_train_batch_size)
        notes.append(  # trace/step/offload.py, estimate/time/cluster.py activation_offloading_s
            f"activation offloading (TRL's): {moved / GIB:.2f} GiB of saved activations per micro-batch go to pinned "
            "host memory and back, by TRL's rules (1 KiB or more, not a parameter, not the output head's; the last 5 "
            "kept on the device while they copy); the copies are timed at an assumed PCIe rate (12 GB/s), hidden under the "
            "forward, not under the backward (which waits for each)")
    if recipe.use_liger_kernel and workload.config is not None:
        notes.append(_liger_note(workload, recipe))
    if recipe.fp8 != "none":  # trace/step/fp8.py
        compiled = ("compiled, the casts fuse (inductor may keep the FP8 casts for backward instead)"
                    if traced_compile(recipe) else
                    "without torch.compile (or under checkpointing, where the blocks run eager) its casts run as "
                    "separate kernels, which torchao says to compile for speed")
        notes.append(f"fp8 ({recipe.fp8}, torchao's Float8Linear as accelerate converts it: every linear layer but the "
                     "first and last, sizes multiples of 16): each FP8 layer keeps its bf16 input and weight for "
                     f"backward and casts them again there, so activations stay as under bf16; {compiled}"
                     + _fp8_gather_note(recipe))
    notes += llm_notes(workload, recipe)
    notes += peft_notes(workload, recipe, traces.size)
    moe = moe_note(workload, recipe)
    if moe is not None:
        notes.append(moe)
    return notes


def _fp8_gather_note(recipe: ResolvedRecipe) -> str:
    """How FSDP gathers the FP8 layers' weights (trace/step/fp8.py)."""
    if recipe.fsdp == "none":
        return ""
    if not recipe.fp8_all_gather:
        return "; FSDP gathers their weights in bf16"
    if traced_float8_gather(recipe):
        return "; FSDP gathers their weights in float8 (accelerate's default): one byte an element gathered and unsharded"
    return ("; FSDP gathers their weights in float8 (the all-gather's time is float8's, its memory traced in bf16 "
            "for compiled blocks: an upper bound)")

def _liger_note(workload: Workload, recipe: ResolvedRecipe) -> str:
    """Liger's fused cross-entropy: its chunk, and what the trace's chunk leaves out (axes/liger.py); under TRL's
    trainers, which keep Liger's layer kernels only, that."""
    if recipe.trainer != "trainer":
        return (f"Liger Kernel {liger_table().version}: stand-ins of its RMSNorm, SwiGLU and RoPE kernels allocate and "
                "save what Liger's own do; TRL turns its fused linear + cross-entropy off (it would replace TRL's own "
                "fused LM head: liger_kernel_config fused_linear_cross_entropy=False)")
    half = recipe.mixed_precision != "no" or recipe.half_weights
    return liger_note(recipe.per_device_train_batch_size, workload.seq_len, workload.facts.hidden_size,
                      workload.facts.vocab_size, 2 if half else 4)
