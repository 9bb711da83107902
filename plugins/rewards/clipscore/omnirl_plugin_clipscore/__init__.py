"""omnirl reward plugin: CLIPScore (image-text agreement of any transformers CLIP checkpoint)."""
