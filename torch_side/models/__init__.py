"""Torch GPT twin (``TorchGPT``) of ``jax_side.models.FlaxGPT``: linear layers are
``bridge.MXFP8Linear`` (JAX MXFP8 GEMMs under Torch autograd); FSDP-shardable by ``torch_side``."""

from torch_side.models.gpt import TorchGPT, cross_entropy, load_flat_params, mxfp8_linears

__all__ = ["TorchGPT", "cross_entropy", "load_flat_params", "mxfp8_linears"]
