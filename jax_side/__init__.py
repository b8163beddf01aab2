"""JAX side: MXFP8 numerics (``jax_side.mxfp8``). Never imports torch (DESIGN.md 2)."""
