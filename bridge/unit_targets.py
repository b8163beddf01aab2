"""What FSDP tells the unit programs (``bridge.units``), without loading JAX.

A parameter's FSDP source (``fsdp_sources[name]``, set by ``torch_side``) may offer
``grad_target() -> GradTarget``: the unit program then lays that gradient out in the sink's flat
buffer (its group's grad bucket) and hands the buffer to ``sink.stage_segment(segment, n)``
instead of returning the gradient to autograd. ``SPECS_CACHE`` names the module attribute where
``bridge.units`` caches what it found (FSDP drops it when it installs its sources).

``UNIT_SPAN`` names the module attribute FSDP sets on each module of a unit of several modules
(a ``unit_modules`` list): the unit's modules in order. ``bridge.units`` runs such a unit of
registered blocks as one program per direction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SPECS_CACHE", "SPAN_PENDING", "UNIT_SPAN", "GradTarget"]

SPECS_CACHE = "_unit_specs"
UNIT_SPAN = "unit_span"
SPAN_PENDING = "_unit_span_pending"  # on a span's modules: its last program call (FSDP drops it)


class GradTarget(NamedTuple):
    """Where a parameter's gradient goes instead of autograd: element ``start`` of a flat
    buffer of ``numel`` elements of ``dtype`` that ``sink.stage_segment(segment, n)`` takes
    whole, ``n`` the gradients in it."""

    sink: object
    numel: int
    dtype: torch.dtype
    start: int
