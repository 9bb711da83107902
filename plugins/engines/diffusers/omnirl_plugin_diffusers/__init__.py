"""omnirl engine plugin: the embedded rollout engine over the flow-model contract."""
