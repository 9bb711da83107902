"""The step loop: the single controller, the inline and Ray executors, workers and their train-side
helpers (micro-batching, torch.distributed, weight sync), interrupts, launching a run, evaluation and trackers."""
