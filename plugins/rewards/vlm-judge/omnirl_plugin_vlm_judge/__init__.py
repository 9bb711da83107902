"""omnirl reward plugin: a VLM judge over the OpenAI-compatible chat-completions API.

Cheap to import: omnirl.toml names the factory and the options as ``"module:attr"`` strings, so aiohttp, numpy
and torch load only when a run uses the reward.
"""
