"""One home per axis of the recipe space, as data: optimizers, precisions, shardings, quantization, kernels, methods.

Each module holds the vocabulary of one axis (the `Literal` a Recipe field is annotated with, and its values) and,
where entries differ by more than a name, their specs (a frozen dataclass per entry, in one table) with the lookups
everyone shares: Recipe validation and the CLI's choices, the tracer, the bytes-per-parameter rule, the time model,
the plan's search space and the emitters. Adding an optimizer is one entry in `optimizers.py`.

Nothing here reads a Recipe (where a recipe stands on an axis: `recipe/axis_values.py`) or builds anything (the
optimizer a trace steps: `trace/step/optimizer_build.py`), and nothing imports torch or transformers.
"""
