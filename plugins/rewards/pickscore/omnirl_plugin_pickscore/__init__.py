"""omnirl reward plugin: PickScore (CLIP-H fine-tuned on Pick-a-Pic human preferences)."""
