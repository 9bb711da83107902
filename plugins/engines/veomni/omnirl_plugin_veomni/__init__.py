"""omnirl engine plugin: training through VeOmni's FSDP2 parallel state, parallelize API and optimizer."""
