"""omnirl engine plugin: training the Qwen3-Omni thinker with Megatron-Core (tensor and expert parallelism)."""
