"""omnirl reward plugin: LAION aesthetic predictor v2 (MLP on CLIP ViT-L/14 image embeddings)."""
