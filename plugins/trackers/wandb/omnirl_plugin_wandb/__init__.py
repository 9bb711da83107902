"""omnirl tracker plugin: Weights & Biases. Importing this module is cheap: wandb is imported at start."""
