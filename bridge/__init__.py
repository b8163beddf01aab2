"""Bridge: zero-copy DLPack between Torch and JAX, and the MXFP8 autograd op (DESIGN.md 6)."""
