"""omnirl reward plugin: JPEG compressibility (DDPO / FlowGRPO): reward = -(JPEG size in kB)."""
