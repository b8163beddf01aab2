"""The GPT twins, above the layers they use (docs/models_and_parity.md).

- ``models.gpt_math``: the GPT's math, once, as JAX functions (``GPTBlockFn``, ``GPTHeadFn``);
- ``models.flax_gpt``: ``FlaxGPT`` (Linen) on ``jax_side``'s linears;
- ``models.torch_gpt``: ``TorchGPT`` on ``bridge.MXFP8Linear``, its blocks registered as unit
  programs (``bridge.units.register_unit``), FSDP-shardable by ``torch_side``.

Nothing is imported here: ``import models.flax_gpt`` loads JAX and Flax only, and
``models.torch_gpt`` brings Torch and the bridge. The layers below (``jax_side``, ``bridge``,
``torch_side``) never import this package.
"""
