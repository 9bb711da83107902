"""omnirl algorithm plugin: DanceGRPO (Dance-SDE, shared group noise, random trained steps)."""
