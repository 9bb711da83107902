"""omnirl engine plugin: SGLang as the rollout engine of autoregressive models, in an environment of its own
(`omnirl env build sglang`). Importing this module is cheap: no torch, no sglang."""
