"""omnirl model plugin: Stable Diffusion 3.5 (diffusers). Importing this module is cheap: no torch."""
