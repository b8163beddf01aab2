"""``Overlap``: how far FSDP's communication runs ahead of (and behind) the compute.

- ``prefetch``: how many units ahead the weight all-gathers are issued, in the execution order
  recorded in the first iteration (``ExecutionOrder``): a unit's pre-forward starts the forward
  planes of the next ``prefetch`` units, its pre-backward the backward planes of the ``prefetch``
  units backward reaches next. 0 gathers each unit's planes only when it runs (no overlap).
  Costs memory: up to ``prefetch + 1`` units' planes are gathered at once.
- ``async_reduce``: gradient reductions are issued without waiting and settled where their
  result is read (``grad_reducer``); ``reductions_in_flight`` bounds how many are in flight (each
  holds its unit's gradient bucket), the oldest settled first. With ``async_reduce=False`` each
  reduction completes before backward moves on.

The numbers never change results: a gather is waited for before its planes are read and a
reduction settled before its gradient is read, in the same order on every rank
(``tests/torch_side/cases_overlap.py`` checks the bytes against ``prefetch=0, async_reduce=False``).
See docs/fsdp.md, "Overlap".
"""

from __future__ import annotations

import dataclasses

__all__ = ["Overlap"]


@dataclasses.dataclass(frozen=True)
class Overlap:
    prefetch: int = 1
    async_reduce: bool = True
    reductions_in_flight: int = 1

    def __post_init__(self) -> None:
        for name, low in (("prefetch", 0), ("reductions_in_flight", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(
                    f"Overlap: {name} must be an int >= {low}, got {v!r} (prefetch: units "
                    f"gathered ahead, 0 for none; reductions_in_flight: at least 1)"
                )
        if not isinstance(self.async_reduce, bool):
            raise ValueError(f"Overlap: async_reduce must be a bool, got {self.async_reduce!r}")

    @classmethod
    def none(cls) -> Overlap:
        """No overlap: gather on demand, reduce synchronously (the reference schedule)."""
        return cls(prefetch=0, async_reduce=False)
