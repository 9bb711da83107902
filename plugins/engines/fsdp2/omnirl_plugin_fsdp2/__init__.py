"""omnirl engine plugin: FSDP2 training over a torch.distributed group (LoRA or full fine-tuning)."""
