"""omnirl engine plugin: vllm-omni as the rollout engine of flow models, in an environment of its own
(`omnirl env build vllm-omni`). Importing this module is cheap: no torch, no vllm."""
