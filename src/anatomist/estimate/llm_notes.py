"""What an estimate says of a causal-LM fine-tune as TRL runs it: the trainer's loss, DPO's
reference model, padding-free micro-batches and packed rows, and what padding costs a recipe without them.

Torch-free: read from the recipe, the workload and its token statistics (`token_stats`).
"""

from __future__ import annotations

from anatomist.recipe import ResolvedRecipe
from anatomist.workload import Workload

MODELLED_TRL = "1.16.0"
"""The trl release whose trainers trace/step/trainers.py and trace/standins/trl_head.py follow."""
MODELLED_CCE = "axolotl-ai-cloud/ml-cross-entropy@5f0c7a7"
"""The Cut Cross-Entropy trace/standins/cce.py follows: the fork axolotl's CutCrossEntropyPlugin installs."""


def llm_notes(workload: Workload, recipe: ResolvedRecipe) -> list[str]:
    """The notes of `recipe` on `workload` (the workload as the recipe trains on it: `Workload.for_recipe`)."""
    notes = []
    batch = recipe.per_device_train_batch_size
    if recipe.trainer != "trainer":
        name = "SFTTrainer" if recipe.trainer == "sft" else "DPOTrainer"
        notes.append(f"TRL's {name} (as trl {MODELLED_TRL} runs it): its fused LM head scores the tokens in tiles of "
                     "4,096 tokens x 32,768 vocabulary; the logits never exist")
    if recipe.trainer == "dpo":
        notes.append(_dpo(workload, recipe))
    if recipe.cut_cross_entropy:
        notes.append(f"Cut Cross-Entropy ({MODELLED_CCE}, as axolotl installs it): the loss from the last hidden "
                     "states and the head's weight, block by block; the logits never exist (per token an fp32 "
                     "log-sum-exp and target logit); its backward recomputes the blocks, counted as if it skipped "
                     "none below filter_eps (an upper bound of the compute)")
    tokens = workload.tokens
    if recipe.packing:
        per_row = f", each about {workload.seq_len / tokens.mean_tokens:.1f} sequences of the data's mean " \
                  f"{tokens.mean_tokens:,.0f} tokens ({tokens.source})" if tokens else ""
        rows = f"{batch} row{'s' if batch != 1 else ''}"
        notes.append(f"packing: {rows} of {workload.seq_len:,} tokens{per_row}, flattened into one row; "
                     "flash_attention_2's varlen kernel keeps per token what SDPA's flash kernel does (traced so), "
                     "and its FLOPs are counted over whole rows, not per sequence (an upper bound)")
    elif recipe.padding_free and tokens is not None:
        notes.append(f"padding-free: {batch} sequences of {workload.seq_len:,} tokens (the data's mean, {tokens.source}) "
                     f"flattened into one row of {batch * workload.seq_len:,} tokens; flash_attention_2's varlen kernel "
                     "keeps per token what SDPA's flash kernel does (traced so)")
    elif tokens is not None:
        longest = tokens.expected_longest(batch)
        notes.append(f"padding: micro-batches are padded to their longest sequence; of {batch} of the data's "
                     f"({tokens.source}: mean {tokens.mean_tokens:,.0f} tokens), the longest has {longest:,.0f} on "
                     f"average: {tokens.padding_share(batch):.0%} of the tokens a step processes are padding "
                     f"({batch * longest:,.0f} for {batch * tokens.mean_tokens:,.0f} of data). The memory above is a "
                     f"micro-batch at the maximum length ({workload.seq_len:,}); padding_free (or packing) would "
                     "process the data's tokens only")
    return notes


def _dpo(workload: Workload, recipe: ResolvedRecipe) -> str:
    pairs = recipe.per_device_train_batch_size
    if recipe.precompute_ref_log_probs:
        reference = "no reference model (its log-probabilities precomputed before training)"
    elif recipe.peft != "none":
        reference = "the reference is the PEFT base with the adapters disabled: no second copy, one more forward"
    else:
        reference = (f"the reference is a second copy of the model ({recipe.dtype}, frozen, counted in weights), "
                     "run without gradients after the policy's forward")
    prompt = (f"; the prompt's {workload.prompt_len:,} tokens of each sequence are not scored" if workload.prompt_len
              else "; every token scored (--prompt-len: the tokens of a prompt, which DPO does not score)")
    return (f"DPO: chosen and rejected of {pairs} pair{'s' if pairs != 1 else ''} run as one batch of {2 * pairs} sequences of "
            f"{workload.seq_len:,} tokens; {reference}{prompt}")
