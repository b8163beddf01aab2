"""The training application: corpora addressed by global sample index, JSONL metrics, loss plots.

Nothing is imported here, so importing the package starts nothing (no Torch, no JAX).
"""
