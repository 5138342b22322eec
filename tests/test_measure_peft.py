"""AnatomistCallback unchanged under a PEFT model: the Trainer over get_peft_model, and TRL's
SFTTrainer given a LoraConfig (how most LLM fine-tunes run), on a tiny Llama on CPU."""

from __future__ import annotations

import json

import pytest

from anatomist.bench.worker import build_dataset, predict, training_model
from anatomist.measure import AnatomistCallback
from anatomist.recipe import Recipe
from anatomist.recipe.spellings import training_arguments
from anatomist.workload_loader import load_workload

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}
RECIPE = Recipe(peft="lora", per_device_train_batch_size=4, lora_r=8, dtype="float32")


@pytest.fixture
def workload(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return load_workload(str(tmp_path), seq_len=32, task="causal-lm")


def _adapter_state_bytes(model) -> int:
    """AdamW's state per trainable (adapter) parameter: two fp32 moments and a scalar step
    tensor, each a storage of its own in 512-byte blocks."""
    return sum(2 * (-(-p.numel() * 4 // 512) * 512) + 512 for p in model.parameters() if p.requires_grad)


def test_callback_under_a_peft_model_in_the_trainer(workload, tmp_path):
    from transformers import Trainer

    model = training_model(workload, RECIPE)
    callback = AnatomistCallback(tokens_per_sample=workload.seq_len, print_at_end=False)
    args = training_arguments(RECIPE, str(tmp_path / "out"), max_steps=3, report_to="none", save_strategy="no",
                                        logging_strategy="no", disable_tqdm=True, use_cpu=True)
    Trainer(model=model, args=args, train_dataset=build_dataset(workload, 16), callbacks=[callback]).train()
    summary = callback.summary
    assert summary is not None and summary.steps == 3
    assert summary.memory.optimizer_states == _adapter_state_bytes(model)  # adapters only, never the frozen base
    predicted = predict(workload, RECIPE.resolved(workload))[0]["memory"]
    assert summary.memory.peak_allocated == pytest.approx(predicted["peak_allocated"], rel=0.05)


def test_callback_under_trl_sft_trainer(workload, tmp_path):
    """SFTTrainer wraps the model itself from a LoraConfig (peft_config=...): the callback sees
    the wrapped model, and measures its adapters' state."""
    from peft import LoraConfig
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {f"t{i}": i for i in range(TINY_LLAMA["vocab_size"])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        eos_token="t1", pad_token="t2", unk_token="t0")
    callback = AnatomistCallback(tokens_per_sample=workload.seq_len, print_at_end=False)
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, max_length=32,
                     gradient_checkpointing=False, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
                     logging_strategy="no", disable_tqdm=True)
    dataset = build_dataset(workload, 16).remove_columns("labels").with_format(None)
    trainer = SFTTrainer(model=workload.build_model("sdpa", "float32"), args=args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=LoraConfig(r=8, task_type="CAUSAL_LM"),
                         callbacks=[callback])
    trainer.train()
    summary = callback.summary
    assert summary is not None and summary.steps == 3
    assert summary.tokens_per_second > 0
    assert summary.memory.optimizer_states == _adapter_state_bytes(trainer.model) > 0
