"""omnirl algorithm plugin: DiffusionNFT (forward-process fine-tuning with an EMA sampler policy)."""
