"""omnirl tracker plugin: TensorBoard. Importing this module is cheap: no torch, no tensorboard."""
