"""omnirl algorithm plugin: GRPO-Guard (FlowGRPO with a normalised ratio and per-step reweighting)."""
