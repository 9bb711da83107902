"""omnirl engine plugin: the embedded rollout engine for autoregressive models. Cheap: no torch."""
