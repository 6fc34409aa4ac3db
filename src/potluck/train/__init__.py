"""LoRA fine-tuning (PyTorch: pip install potluck[train]); the adapters it writes run on ggml."""
