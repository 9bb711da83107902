"""omnirl reward plugin: ImageReward (BLIP ViT-L + BERT cross-attention + MLP head)."""
