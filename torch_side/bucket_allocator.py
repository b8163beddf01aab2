"""Allocator for the temporary unsharded buckets (all-gathered weights, gradient staging).

A bucket is keyed by (owner label, purpose). ``free`` drops the allocator's reference only; the
storage itself is released by Torch when the last user lets go. That is what keeps a bucket alive
while JAX still reads it through the bridge: a DLPack export holds a reference to the Torch
storage until JAX drops its array, and on CUDA the bridge orders Torch's stream after JAX's reads
(DESIGN.md 6), so freeing here can never hand memory that JAX is reading to a new bucket.
``live_bytes`` / ``peak_bytes`` count what the allocator has handed out and not yet freed.
"""

from __future__ import annotations

import torch

__all__ = ["BucketAllocator"]


class BucketAllocator:
    def __init__(self) -> None:
        self._live: dict[tuple[str, str], torch.Tensor] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def allocate(
        self, owner: str, purpose: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero-filled 1-D bucket; error if (owner, purpose) is already live (a leak)."""
        key = (owner, purpose)
        if key in self._live:
            raise RuntimeError(
                f"BucketAllocator: bucket {key} is still live; free it (reshard) before "
                f"allocating it again"
            )
        t = torch.zeros(numel, dtype=dtype, device=device)
        self._live[key] = t
        self.live_bytes += t.numel() * t.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return t

    def get(self, owner: str, purpose: str) -> torch.Tensor | None:
        return self._live.get((owner, purpose))

    def free(self, owner: str, purpose: str) -> None:
        t = self._live.pop((owner, purpose), None)
        if t is not None:
            self.live_bytes -= t.numel() * t.element_size()

    def live_keys(self) -> list[tuple[str, str]]:
        return sorted(self._live)
