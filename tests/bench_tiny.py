"""A tiny suite file for bench tests: runs in seconds per row on CPU."""

from __future__ import annotations

from pathlib import Path

TINY_SUITE = """
name: tiny
model: bert-base-uncased
seq_len: 512
num_samples: 512
cpu:
  model_config: {model_type: bert, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
                 intermediate_size: 64, vocab_size: 30522, max_position_embeddings: 64}
  seq_len: 16
  num_samples: 16
rows:
  - name: first
    recipe: {per_device_train_batch_size: 4}
  - name: needs-gpu
    recipe: {per_device_train_batch_size: 4, fp16: true}
    needs: [cuda]
  - name: accum
    recipe: {per_device_train_batch_size: 2, gradient_accumulation_steps: 2}
"""


def write_tiny_suite(folder: Path) -> Path:
    path = folder / "tiny.yaml"
    path.write_text(TINY_SUITE)
    return path
