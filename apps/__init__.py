"""Applications above the library layers: training and parity (their data, command lines).

No library layer (``common``, ``jax_side``, ``bridge``, ``torch_side``) imports this package.
"""
