"""omnirl reward plugin: Human Preference Score v2 / v2.1 (open_clip ViT-H-14 checkpoint, run via transformers)."""
