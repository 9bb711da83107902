"""omnirl model plugin: Qwen-Image (diffusers). Importing this module is cheap: no torch."""
