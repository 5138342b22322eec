"""The tracer: a dispatch mode recording every allocation, free and op cost of a step on fake tensors,
the torch-free records it leaves, and the replay of PyTorch's caching allocator over them."""
