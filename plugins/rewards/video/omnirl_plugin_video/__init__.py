"""omnirl reward plugin: video rewards (an image reward per frame; temporal consistency)."""
