"""What a trace keeps of the model: the cut types, the kinds of block a model stacks, configs cut
to a depth, which cuts to trace, and FSDP ranks at world sizes never traced."""
