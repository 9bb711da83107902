"""omnirl algorithm plugin: MixGRPO (mixed ODE-SDE rollout with a sliding SDE window; Flash variant)."""
