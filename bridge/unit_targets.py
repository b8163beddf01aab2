"""What FSDP tells a unit program about gradients (``bridge.units``), without loading JAX.

A parameter's FSDP source (``fsdp_sources[name]``, set by ``torch_side``) may offer
``grad_target() -> GradTarget``: the unit program then lays that gradient out in the sink's flat
buffer (its group's grad bucket) and hands the buffer to ``sink.stage_segment(segment, n)``
instead of returning the gradient to autograd. ``SPECS_CACHE`` names the module attribute where
``bridge.units`` caches what it found (FSDP drops it when it installs its sources).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SPECS_CACHE", "GradTarget"]

SPECS_CACHE = "_unit_specs"


class GradTarget(NamedTuple):
    """Where a parameter's gradient goes instead of autograd: element ``start`` of a flat
    buffer of ``numel`` elements of ``dtype`` that ``sink.stage_segment(segment, n)`` takes
    whole, ``n`` the gradients in it."""

    sink: object
    numel: int
    dtype: torch.dtype
    start: int
