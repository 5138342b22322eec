"""What prediction and measurement share: tracing a real or fake training step.

Five concerns, one subpackage each, imported in this order (a later one may import an earlier
one, never the other way round):
- `depth`: what a trace keeps of the model (`cuts`: the cut types; `layout`: the kinds of block a
  model stacks; `configs`: a config cut to a depth; `plan`: which cuts to trace and how they add
  up; `worlds`: an FSDP rank at a world size never traced, from two that were);
- `engine`: the tracer (`tracer`: every allocation, free and op's cost; `op_costs`; `records`:
  torch-free results; `allocator`: PyTorch's caching allocator replayed; `autocast`,
  `cuda_paths`: CUDA's behaviour on a CPU torch);
- `standins`: third-party GPU kernels as they allocate (Liger, Cut Cross-Entropy, TRL's fused LM
  head, low-bit Adam), each registering its own FLOP formulas;
- `step`: the Trainer's step the engine runs (`driver.trace_step`) and its variants (`inputs`,
  `trainers`, `peft`, `experts`, `fsdp`, `compiled`, `offload`);
- `store`: what shapes a trace and where it is kept (`keys`, `cache`, `parts`, `pool`).

`estimate/` extrapolates traces into predictions; `measure/` attributes real steps with the
same tracer.
"""
