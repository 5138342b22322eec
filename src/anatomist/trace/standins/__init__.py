"""Stand-ins for third-party GPU kernels a CPU torch cannot run: each allocates and saves what the
kernel does, and registers the FLOPs of its ops with `torch.utils.flop_counter`."""
