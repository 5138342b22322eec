"""What prediction and measurement share: tracing a real or fake training step.

- `step`: building the model cut to a depth, the inputs, the Trainer's step, `trace_part`;
- `tracer`: the dispatch mode that records allocations, frees and each op's cost;
- `ops`: what one op costs (FLOPs, bytes, class);
- `cuda_model`: the CUDA code paths a CPU-only torch is steered onto;
- `optimizers`: the optimizer the Trainer would build;
- `records`, `allocator`: torch-free results and the caching-allocator replay;
- `cache`: the in-memory and on-disk trace cache;
- `pool`: tracing several parts side by side in forked processes.

`estimate/` extrapolates traces into predictions; `measure/` attributes real steps with the
same tracer.
"""
