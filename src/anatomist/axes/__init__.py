"""One registry per axis of the recipe space: optimizers, precisions, shardings.

Each module holds the specs of one axis (a frozen dataclass per entry, in one table) and the
lookups its consumers share: Recipe validation and the CLI's choices, the tracer (how to build
the optimizer on fake tensors), the bytes-per-parameter rule, the time model, the plan's search
space and the emitters (how TrainingArguments, accelerate and DeepSpeed spell it). Adding an
optimizer is one entry in `optimizers.py`.

Nothing here imports torch or transformers: a spec's `build` imports what it needs when called.
"""
