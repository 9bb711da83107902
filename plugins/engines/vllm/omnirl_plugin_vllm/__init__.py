"""omnirl engine plugin: vLLM as the rollout engine of autoregressive models, in an environment of its own
(`omnirl env build vllm`). Importing this module is cheap: no torch, no vllm."""
