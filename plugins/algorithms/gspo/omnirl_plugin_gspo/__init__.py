"""omnirl algorithm plugin: GSPO and token-level GRPO for autoregressive (ar-text) models. Cheap: no torch."""
