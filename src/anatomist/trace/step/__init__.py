"""The training step the tracer runs: the Trainer's forward, backward and optimizer step, and its
variants (PEFT, Mixture-of-Experts kernels, FSDP2, torch.compile, activation offloading, TRL's losses)."""
