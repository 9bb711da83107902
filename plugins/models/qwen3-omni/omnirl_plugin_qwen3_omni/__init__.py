"""omnirl model plugin: the Qwen3-Omni thinker (transformers). Importing this module is cheap: no torch."""
