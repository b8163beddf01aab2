"""``GPTInit``: the GPT's initial values as a function of position, so that each rank can
materialise its own shard of a model built on the meta device (``torch_side.fsdp.meta_init``).

The rule (seed ``s``, parameter ``name``, element index ``i`` in the parameter's row-major order):

- 2-D parameters (embeddings and linear weights): ``fp32(init_std * z)`` with ``z`` a standard
  normal by Box-Muller, ``z = sqrt(-2 ln u1) cos(2 pi u2)``, computed in float64 from the 64-bit
  splitmix64 output ``r`` of ``key(s, name) + (i + 1) * 0x9E3779B97F4A7C15`` (``u1`` from its high
  32 bits, ``u2`` from its low 32 bits, each ``(bits + 0.5) / 2**32``), ``key`` the first 8
  bytes of ``sha256("<s>:<name>")``;
- LayerNorm weights: 1; LayerNorm biases: 0 (as ``TorchGPT`` initialises them).

An element's value depends on nothing drawn before it, so any slice is computed alone, in chunks
of ``CHUNK`` elements (bounded temporaries). It is not ``TorchGPT``'s default initialisation
(a sequential ``torch.Generator`` stream, which cannot be drawn in pieces): a model initialised by
this rule, whole (``torch_side.materialize``) or per shard (``fully_shard(..., init=...)``), has
other initial weights than ``TorchGPT(cfg, seed=s)``, the same in both cases.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from common.model_config import GPTConfig

__all__ = ["CHUNK", "GPTInit"]

CHUNK = 1 << 18  # elements computed at once (about 100 bytes of temporaries each)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class GPTInit:
    """``ParamInit`` of the GPT (module note): ``GPTInit(cfg, seed).fill(name, shape, start,
    out)``."""

    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, int(seed)

    def _key(self, name: str) -> np.uint64:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return np.uint64(int.from_bytes(digest[:8], "little"))

    def fill(self, name: str, shape: tuple[int, ...], start: int, out: torch.Tensor) -> None:
        if out.dtype != torch.float32 or out.dim() != 1:
            raise TypeError(f"GPTInit.fill({name!r}): out must be a 1-D float32 tensor, got "
                            f"{out.dtype} of shape {tuple(out.shape)}")
        if len(shape) == 1:
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in ("weight", "bias"):
                raise ValueError(f"GPTInit: 1-D parameter {name!r} is not a LayerNorm's")
            out.fill_(1.0 if leaf == "weight" else 0.0)
            return
        key = self._key(name)
        std = float(self.cfg.init_std)
        n = out.numel()
        with np.errstate(over="ignore"):
            for lo in range(0, n, CHUNK):
                idx = np.arange(start + lo + 1, start + min(lo + CHUNK, n) + 1, dtype=np.uint64)
                r = _splitmix64(key + idx * _GOLDEN)
                u1 = ((r >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
                u2 = ((r & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * 2.0**-32
                z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
                out[lo:lo + len(idx)] = torch.from_numpy((std * z).astype(np.float32))
