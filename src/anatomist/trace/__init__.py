"""What prediction and measurement share: tracing a real or fake training step.

One job per module:
- `keys`: what shapes a trace (`part_key`, the depths and cuts, the code digest): torch-free;
- `parts`: which traces a step needs, from the cache, forked workers (`pool`) or this process;
- `driver`: the Trainer's step under the tracer (`trace_step`);
- `cutting`: the config of a model cut to a few blocks; `stack`, `cuts`: which cuts to trace;
- `inputs`: the micro-batch; `peft`: LoRA/QLoRA on the traced model; `experts`: MoE kernels;
- `tracer`: the dispatch mode that records allocations, frees and each op's cost; `ops`: what
  one op costs (FLOPs, bytes, class); `autocast`, `cuda_model`: CUDA's behaviour on a CPU torch;
  `optimizer_layouts`: low-bit optimizers' state;
- `records`, `allocator`: torch-free results and the caching-allocator replay;
- `cache`: the in-memory and on-disk trace cache.

`estimate/` extrapolates traces into predictions; `measure/` attributes real steps with the
same tracer.
"""
