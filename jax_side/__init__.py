"""JAX side (DESIGN.md 2): MXFP8 numerics (``jax_side.mxfp8``), the one JAX MXFP8 linear layer
(``jax_side.linear``, with its slow reference ``jax_side.linear_reference``) and the unit programs
(``jax_side.unit_program``). The Flax GPT twin is ``models.flax_gpt``. Never imports torch."""
