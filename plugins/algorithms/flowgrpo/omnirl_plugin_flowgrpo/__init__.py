"""omnirl algorithm plugin: FlowGRPO (online RL for flow-matching models via an SDE rollout)."""
