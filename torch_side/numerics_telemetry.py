"""MXFP8 numerics telemetry of a wrapped model's MXFP8 groups, per plane, after each update.

``NumericsTelemetry(model)`` listens to every MXFP8 group's requantization (the group's
``amax_observer``: it receives the reduced packed block amax that every rank holds after the
distributed quantization's all-reduce MAX, DESIGN.md 5) and ``collect()`` returns, per group and
plane (``PlaneTelemetry``):

- **scale exponents**: how many blocks have each E8M0 scale exponent ``byte - 127`` (from the
  replicated scales: no collective), and how many carry the NaN scale byte 0xFF;
- **changed blocks**: blocks whose scale byte differs from the previous ``collect()`` (or from
  when the telemetry started);
- **zero / subnormal elements**: E4M3 bytes that are +-0 (``byte & 0x7F == 0``) or subnormal
  (exponent field 0, mantissa != 0: ``1 <= byte & 0x7F <= 7``). These need the elements, which are
  sharded: each rank counts the pieces it accounts for (``rank_share``) and ONE all-reduce SUM of
  3 int64 per group and plane adds them up -- exact totals over the whole model, at any world size;
- **amax headroom** of the latest quantization, in bits, per block with a finite amax > 0:
  ``h = log2(448 * 2**(E - 127) / amax)``, how far the block's largest element, once scaled, sits
  below the E4M3 maximum 448. The RCEIL scale rule (DESIGN.md 3) keeps h in [0, 1) for normal
  blocks; h < 0 means the block saturates (E clamped at 254), h >= 1 that its scale is at the E8M0
  floor (tiny amax). Summarised as mean, min and max over the blocks, with the count of all-zero
  blocks (amax 0: scale byte 0, no headroom); None when no quantization ran since the last
  ``collect()`` (e.g. a skipped step).

Expert groups count over the DP group (every expert once); their scale histograms are this rank's
expert-DP group's. Cost: a bincount and a compare over the scale bytes (1/32 of the elements),
two compares over the rank's plane bytes, a few elementwise ops over the amax, one small
all-reduce, and one device-to-host copy of the counts (measured in docs/training.md).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from common.formats import BLOCK_SIZE, E4M3_MAX, E8M0_BIAS, Plane
from torch_side.collectives import Collective, Phase
from torch_side.fsdp_model import FSDPModel
from torch_side.param_group import ParamGroup
from torch_side.rank_share import rank_share

__all__ = ["Headroom", "NumericsTelemetry", "PlaneTelemetry"]

_E4M3_MAX_LOG2 = math.log2(E4M3_MAX)
_NAN_SCALE = 255


class Headroom(NamedTuple):
    """Amax headroom (bits) over the blocks of one plane with a finite amax > 0."""

    blocks: int  # blocks summarised
    mean: float
    min: float
    max: float
    zero_blocks: int  # blocks whose amax is 0 (left out of the summary)


class PlaneTelemetry(NamedTuple):
    """One MXFP8 plane of one group at one step (see the module note)."""

    scale_exponents: dict[int, int]  # E8M0 exponent (byte - 127) -> blocks, bytes 0..254
    nan_scales: int  # blocks with scale byte 0xFF
    blocks: int
    changed_blocks: int  # scale byte changed since the previous collect()
    zero: int  # elements quantized to +-0, over every rank
    subnormal: int  # elements quantized to a subnormal E4M3 value
    elements: int
    headroom: Headroom | None  # None: no quantization since the previous collect()

    def as_record(self) -> dict:
        """JSON-ready: the histogram as ``{"lo": first exponent, "counts": [...]}`` (dense),
        counts, their shares, and the headroom summary (or None)."""
        exps = sorted(self.scale_exponents)
        hist = ({"lo": exps[0], "counts": [self.scale_exponents.get(e, 0)
                                           for e in range(exps[0], exps[-1] + 1)]}
                if exps else {"lo": 0, "counts": []})
        share = lambda n, d: n / d if d else None  # noqa: E731
        return {
            "scale_exp": hist, "nan_scales": self.nan_scales, "blocks": self.blocks,
            "changed_blocks": self.changed_blocks,
            "changed_share": share(self.changed_blocks, self.blocks),
            "zero": self.zero, "subnormal": self.subnormal, "elements": self.elements,
            "zero_share": share(self.zero, self.elements),
            "subnormal_share": share(self.subnormal, self.elements),
            "headroom_bits": None if self.headroom is None else self.headroom._asdict(),
        }


def _headroom(amax: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """float64 (5,): blocks, sum, min, max, zero blocks of one slot's headroom."""
    e = scale_bytes.reshape(-1).to(torch.float32)
    ok = (amax > 0) & torch.isfinite(amax) & (scale_bytes.reshape(-1) != _NAN_SCALE)
    h = (e - E8M0_BIAS + _E4M3_MAX_LOG2) - torch.log2(torch.where(ok, amax, 1.0))
    h = h.double()
    inf = torch.tensor(math.inf, dtype=torch.float64, device=h.device)
    return torch.stack([
        ok.sum().double(), torch.where(ok, h, 0.0).sum(),
        torch.where(ok, h, inf).min(), torch.where(ok, h, -inf).max(),
        (amax == 0).sum().double(),
    ])


class NumericsTelemetry:
    """Telemetry of ``model``'s MXFP8 groups (module note). A collective object: every rank
    makes one and calls ``collect()`` at the same points. ``close()`` detaches it."""

    def __init__(self, model: FSDPModel):
        self.model = model
        self.groups = [g for g in model.param_groups if g.scale_buffers]
        self._prev = {(g.label, p): b.clone() for g in self.groups
                      for p, b in g.scale_buffers.items()}
        self._headroom: dict[str, torch.Tensor] = {}  # label -> (planes, 5), latest refresh
        for g in self.groups:
            g.buffers.amax_observer = functools.partial(self._observe, g)

    def close(self) -> None:
        for g in self.groups:
            g.buffers.amax_observer = None

    def _observe(self, g: ParamGroup, packed: torch.Tensor) -> None:
        """The group's reduced packed amax ``[row_0, col_0, row_1, col_1, ...]`` (each in its
        scale tensor's row-major order), right after its scales were written."""
        per_plane = {p: [] for p in (Plane.ROWWISE, Plane.COLWISE)}
        offset = 0
        for i, slot in enumerate(g.layout.slots):
            n = slot.numel // BLOCK_SIZE
            for k, p in enumerate((Plane.ROWWISE, Plane.COLWISE)):
                amax = packed[offset + k * n:offset + (k + 1) * n]
                per_plane[p].append(_headroom(amax, g.scales[p][i]))
            offset += 2 * n
        rows = []
        for p in g.planes:
            s = torch.stack(per_plane[p])
            rows.append(torch.stack([s[:, 0].sum(), s[:, 1].sum(), s[:, 2].min(),
                                     s[:, 3].max(), s[:, 4].sum()]))
        self._headroom[g.label] = torch.stack(rows)

    def _element_counts(self, g: ParamGroup, plane: Plane) -> torch.Tensor:
        zero = sub = torch.zeros((), dtype=torch.int64, device=g.device)
        n = 0
        for share in rank_share(g.model[plane], g.layout, g.comm.rank):
            mag = share.values & 0x7F
            zero = zero + (mag == 0).sum()
            sub = sub + ((mag > 0) & (mag < 8)).sum()
            n += share.values.numel()
        return torch.stack([zero, sub, torch.tensor(n, device=g.device)])

    def _scale_counts(self, g: ParamGroup, plane: Plane) -> torch.Tensor:
        """int64 (257,): bincount of the scale bytes (padding taken out), changed blocks."""
        buf = g.scale_buffers[plane]
        real = sum(v.numel() for v in g.scales[plane])
        hist = torch.bincount(buf.to(torch.int64), minlength=256)
        hist[0] -= buf.numel() - real  # the alignment padding between parameters: zero bytes
        prev = self._prev[g.label, plane]
        changed = (buf != prev).sum()  # padding never changes
        prev.copy_(buf)
        return torch.cat([hist, changed.reshape(1)])

    def collect(self) -> dict[str, dict[str, PlaneTelemetry]]:
        """COLLECTIVE (one all-reduce SUM over the DP group): {group label: {plane: stats}}."""
        if not self.groups:
            return {}
        elements = torch.stack([self._element_counts(g, p)
                                for g in self.groups for p in g.planes])
        self.model.comms["dp"].all_reduce(elements, Collective.ALL_REDUCE_SUM, Phase.STATE,
                                          "telemetry")
        scales = torch.stack([self._scale_counts(g, p) for g in self.groups for p in g.planes])
        elements, scales = elements.cpu().tolist(), scales.cpu().tolist()
        headroom = {k: v.cpu().tolist() for k, v in self._headroom.items()}
        self._headroom.clear()
        out: dict[str, dict[str, PlaneTelemetry]] = {}
        row = 0
        for g in self.groups:
            for k, p in enumerate(g.planes):
                hist, changed = scales[row][:256], scales[row][256]
                h = headroom.get(g.label)
                out.setdefault(g.label, {})[p.value] = PlaneTelemetry(
                    scale_exponents={b - E8M0_BIAS: c for b, c in enumerate(hist[:255]) if c},
                    nan_scales=hist[_NAN_SCALE], blocks=sum(hist), changed_blocks=changed,
                    zero=elements[row][0], subnormal=elements[row][1],
                    elements=elements[row][2],
                    headroom=None if h is None else Headroom(
                        int(h[k][0]), h[k][1] / h[k][0] if h[k][0] else math.nan,
                        h[k][2], h[k][3], int(h[k][4])),
                )
                row += 1
        return out
