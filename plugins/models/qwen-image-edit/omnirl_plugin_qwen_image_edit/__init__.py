"""omnirl model plugin: Qwen-Image-Edit and Qwen-Image-Edit-Plus (diffusers). Importing this module is cheap: no torch."""
