"""Power budgets: a cap for a group of GPUs, shared among its jobs (`allocator` is the core)."""
