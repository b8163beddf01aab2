"""What ``--telemetry`` and ``--digest`` add to a run's metrics records (``Trainer`` calls it).

- ``--telemetry``: each step record gets ``telemetry`` = {group label: {plane: stats}}
  (``torch_side.instruments.numerics_telemetry``: scale-exponent histogram, zero / subnormal element
  shares, changed scale blocks, amax headroom) and ``telemetry_s``, the seconds collecting it took
  on rank 0 (outside ``step_s``). ``--telemetry-every N``: only the records of steps whose index is
  a multiple of N (changed blocks count since the previous such step); on the other steps the
  amax observer returns at once and nothing is collected.
- ``--digest``: each step record gets ``digest`` = {group label: {tensor: 16 hex digits}}
  (``torch_side.instruments.step_digest``): the reduced gradient of the step (hashed before the
  update) and the main weights, planes and scales after it; the run record gets ``digest`` of the
  state the run starts from (the initial weights, or the resumed checkpoint's), and each step record
  ``digest_s`` (its gradient part runs before the update, so inside ``step_s`` too).
  ``mxfp8-digest-diff`` (``apps.training.digest_diff``) compares two files.

Both are collectives: every rank calls ``start_fields``, ``before_update`` and ``after_update``
in the same order; rank 0 writes what they return.
"""

from __future__ import annotations

import time
from typing import Any

from torch_side.fsdp.fsdp_model import FSDPModel
from torch_side.instruments.numerics_telemetry import NumericsTelemetry
from torch_side.instruments.step_digest import (
    GRAD_TENSORS,
    STATE_TENSORS,
    Partials,
    combine,
    local_partials,
    model_digest,
)

__all__ = ["StepInstruments"]


class StepInstruments:
    """The run's telemetry and digests (each off unless asked for: then every call is free)."""

    def __init__(self, model: FSDPModel, *, telemetry: bool, digest: bool,
                 telemetry_every: int = 1):
        self.model, self.digest, self.telemetry_every = model, digest, telemetry_every
        self.telemetry = NumericsTelemetry(model) if telemetry else None
        self._collect = telemetry  # this step records telemetry (set by before_update)
        self._grads: Partials = {}
        self._grads_s = 0.0

    def start_fields(self) -> dict[str, Any]:
        """COLLECTIVE: the run record's fields (the digest of the state the run starts from)."""
        return {"digest": model_digest(self.model, STATE_TENSORS)} if self.digest else {}

    def before_update(self, step: int) -> None:
        """Before step ``step``'s update: this rank's partial gradient digests, while the
        reduced gradients exist; whether the telemetry observes this update's requantization
        (the steps it records, ``telemetry_every``)."""
        if self.telemetry is not None:
            self._collect = step % self.telemetry_every == 0
            self.telemetry.observing = self._collect
        if self.digest:
            t0 = time.perf_counter()
            self._grads = local_partials(self.model, GRAD_TENSORS)
            self._grads_s = time.perf_counter() - t0

    def after_update(self) -> dict[str, Any]:
        """COLLECTIVE: the step record's fields, after the update."""
        out: dict[str, Any] = {}
        if self.telemetry is not None and self._collect:
            t0 = time.perf_counter()
            stats = self.telemetry.collect()
            out["telemetry"] = {label: {plane: s.as_record() for plane, s in planes.items()}
                                for label, planes in stats.items()}
            out["telemetry_s"] = time.perf_counter() - t0
        if self.digest:
            t0 = time.perf_counter()
            state = local_partials(self.model, STATE_TENSORS)
            out["digest"] = combine(self.model, {**self._grads, **state})
            out["digest_s"] = self._grads_s + time.perf_counter() - t0
            self._grads = {}
        return out

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
