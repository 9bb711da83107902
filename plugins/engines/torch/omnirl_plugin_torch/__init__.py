"""omnirl engine plugin: single-process PyTorch training (LoRA or full fine-tuning)."""
