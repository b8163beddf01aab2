"""The hybrid training application: Torch FSDP + JAX MXFP8 GEMMs on a GPT (``python -m
apps.training``)."""
