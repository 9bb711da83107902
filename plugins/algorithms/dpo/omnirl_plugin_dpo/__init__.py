"""omnirl algorithm plugin: Diffusion-DPO for flow matching (online pairs, or offline preference files)."""
