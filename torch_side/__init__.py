"""Torch side: FSDP buffers, communication and training (DESIGN.md 5)."""
