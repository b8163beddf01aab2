"""Numerics telemetry of a wrapped model's block-scaled groups, per plane, after each update.

``NumericsTelemetry(model)`` listens to every block-scaled group's requantization (the group's
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
  below the E4M3 maximum 448 (the format's ``element_max``). The RCEIL scale rule (DESIGN.md 3)
  keeps h in [0, 1) for normal blocks; h < 0 means the block saturates (E clamped at 254), h >= 1
  that its scale is at the E8M0 floor (tiny amax). Summarised as mean, min and max over the
  blocks, with the count of all-zero blocks (amax 0: scale byte 0, no headroom); None when no
  quantization ran since the last ``collect()`` (e.g. a skipped step).

Expert groups count over the DP group (every expert once); their scale histograms are this rank's
expert-DP group's. What a group's blocks are comes from its format (``ParamGroup.blocks``: block
size, element max), so any format of E4M3 elements and E8M0 scales is counted, whatever its
block size; groups of other element or scale types are refused by name.

Cost (measured in docs/training.md): the step is often host-bound, so the number of Torch calls
matters as much as the bytes. Everything a step reads is located once, in ``__init__``, as index
tensors per group (``_GroupIndex``: the packed amax -> one rowwise and one columnwise vector,
the scale bytes of those blocks, the span of the rank's plane elements and the padding inside
it), so no step loops over parameters or pieces and no step makes a tensor from host data:

- an observed refresh: ~30 calls per group (two gathers, elementwise ops and row reductions
  over a (2, blocks) array), summarised at once -- cheaper than keeping a clone of the amax for
  ``collect()``, and nothing keeps the amax alive;
- ``collect()``: per group and plane, two compares and sums over the rank's plane bytes (and
  over the padding between its pieces); for all groups at once, one concatenation of the scale
  bytes, one compare with the previous collect's, ONE histogram of the keys
  ``512 * row + 256 * changed + byte`` (a sort and a search of the bin edges: exact,
  deterministic, and no device sync, unlike ``bincount``), the all-reduce, and ONE
  device-to-host copy of one table (rows x 265 float64; the counts exact below 2**53).

``observing = False`` (``--telemetry-every N`` between recorded steps) makes the observer return
at once, so steps that are not recorded pay nothing.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from common.formats import E8M0_BIAS, Plane, ScaleBlocks
from torch_side.comm.collectives import Collective, Phase
from torch_side.fsdp.fsdp_model import FSDPModel
from torch_side.fsdp.param_group import ParamGroup
from torch_side.instruments.rank_share import rank_share

__all__ = ["Headroom", "NumericsTelemetry", "PlaneTelemetry"]

_COUNTED = ("float8_e4m3fn", "float8_e8m0fnu")  # the (element, scale) dtypes counted here
_NAN_SCALE = 255
_PLANES = (Plane.ROWWISE, Plane.COLWISE)  # the packed amax's plane order
_BINS = 512  # per (group, plane) row of the scale histogram: 256 bytes x (unchanged, changed)


class _GroupIndex(NamedTuple):
    """Made once per group (``NumericsTelemetry.__init__``): where a collect reads, as index
    tensors on the group's device, so that no step loops over parameters or pieces."""

    amax: torch.Tensor  # int64 (2B,): packed amax -> [rowwise blocks..., colwise blocks...]
    scales: torch.Tensor  # int64 (2B,): cat(row, col scale buffer) -> the same blocks' bytes
    span: tuple[int, int]  # this rank's elements of each g.model[plane] lie in [lo, hi) ...
    gaps: torch.Tensor | None  # ... except these (int64, from lo): padding between its pieces
    local_elements: int  # elements this rank counts per plane


def _blocks(g: ParamGroup) -> ScaleBlocks:
    assert g.blocks is not None, g.label  # the telemetry counts block-scaled groups only
    return g.blocks


def _group_index(g: ParamGroup) -> _GroupIndex:
    amax: dict[Plane, list[torch.Tensor]] = {p: [] for p in _PLANES}
    scale_idx, offset = [], 0
    blocks = _blocks(g)
    for slot, start in zip(g.slots, g.scale_offsets, strict=True):
        n = blocks.scale_numel(slot.matrix_shape)  # blocks per plane (both planes: M*K/block)
        for k, p in enumerate(_PLANES):
            amax[p].append(torch.arange(offset + k * n, offset + (k + 1) * n))
        scale_idx.append(torch.arange(start, start + n))
        offset += 2 * n
    scale_idx = torch.cat(scale_idx)
    width = g.scale_buffers[Plane.ROWWISE].numel()
    buf = g.model[g.planes[0]]  # every plane's buffer has the same size, so the same pieces
    ranges = sorted((s.values.storage_offset() - buf.storage_offset(), s.values.numel())
                    for s in rank_share(buf, g.layout, g.comm.rank))
    lo, hi = (ranges[0][0], ranges[-1][0] + ranges[-1][1]) if ranges else (0, 0)
    gaps = [torch.arange(a + n - lo, b - lo)
            for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False) if b > a + n]
    return _GroupIndex(
        amax=torch.cat(amax[Plane.ROWWISE] + amax[Plane.COLWISE]).to(g.device),
        scales=torch.cat([scale_idx, scale_idx + width]).to(g.device),
        span=(lo, hi), gaps=torch.cat(gaps).to(g.device) if gaps else None,
        local_elements=sum(n for _, n in ranges),
    )


def _low_counts(b: torch.Tensor) -> list[torch.Tensor]:
    """E4M3 bytes ``b``: [+-0 count, count with exponent field 0 (zero or subnormal)]."""
    mag = b & 0x7F
    return [(mag == 0).sum(), (mag < 8).sum()]


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


def _headroom(amax: torch.Tensor, scale_bytes: torch.Tensor, max_log2: float) -> torch.Tensor:
    """float64 (planes, 5): blocks, sum, min, max, zero blocks of the headroom of each row of
    ``amax`` / ``scale_bytes`` (planes, blocks); ``max_log2``: log2 of the element max."""
    e = scale_bytes.to(torch.float32)
    ok = (amax > 0) & torch.isfinite(amax) & (scale_bytes != _NAN_SCALE)
    h = ((e - E8M0_BIAS + max_log2) - torch.log2(torch.where(ok, amax, 1.0))).double()
    return torch.stack([
        ok.sum(1).double(), torch.where(ok, h, 0.0).sum(1),
        torch.where(ok, h, math.inf).amin(1), torch.where(ok, h, -math.inf).amax(1),
        (amax == 0).sum(1).double(),
    ], 1)


class NumericsTelemetry:
    """Telemetry of ``model``'s block-scaled groups (module note). A collective object: every rank
    makes one and calls ``collect()`` at the same points. ``close()`` detaches it.

    ``observing``: whether a refresh's amax is summarised (headroom). A caller that collects
    only every N steps sets it False on the other steps' refreshes, which then cost nothing;
    ``collect()`` reports the headroom of the latest observed refresh since the previous one."""

    def __init__(self, model: FSDPModel):
        self.model = model
        self.groups = [g for g in model.param_groups if g.scale_buffers]
        others = {g.label: g.blocks for g in self.groups
                  if (_blocks(g).element_dtype, _blocks(g).scale_dtype) != _COUNTED}
        if others:
            raise ValueError(
                f"NumericsTelemetry counts {_COUNTED[0]} elements with {_COUNTED[1]} scales; "
                f"groups {others} hold other types: leave them out of the telemetry"
            )
        bf16_gathered = [g.label for g in self.groups if g.codec.quantizes_after_gather]
        if bf16_gathered:
            raise ValueError(
                f"NumericsTelemetry: groups {bf16_gathered} gather bf16 weights and quantize "
                f"them after each gather (GatherMode.BF16), so they hold no MXFP8 shards to "
                f"count; run the telemetry with MXFP8 gathers (--gather mxfp8)"
            )
        self.observing = True
        self._index = {g.label: _group_index(g) for g in self.groups}
        self._rows = [(g, p) for g in self.groups for p in g.planes]  # one row per group, plane
        device = self.groups[0].device if self.groups else torch.device("cpu")
        # constants of collect(), made once: per row, elements this rank counts, the alignment
        # padding (zero bytes) in its scale buffer, and its first histogram bin
        idx = self._index
        self._local_elements = torch.tensor(
            [idx[g.label].local_elements for g, _ in self._rows], dtype=torch.int64,
            device=device)
        self._scale_padding = torch.tensor(
            [g.scale_buffers[p].numel() - sum(v.numel() for v in g.scales[p])
             for g, p in self._rows], dtype=torch.int64, device=device)
        self._bin_base = torch.cat([
            torch.full((g.scale_buffers[p].numel(),), r * _BINS, dtype=torch.int64)
            for r, (g, p) in enumerate(self._rows)]).to(device) if self._rows else None
        self._bin_edges = torch.arange(len(self._rows) * _BINS + 1, device=device)
        self._none = torch.zeros((), dtype=torch.int64, device=device)
        self._no_headroom = torch.full((2, 5), math.nan, dtype=torch.float64, device=device)
        self._prev = self._scale_bytes() if self._rows else None
        self._headroom: dict[str, torch.Tensor] = {}  # label -> (2, 5), latest observed refresh
        for g in self.groups:
            g.observe_amax(functools.partial(self._observe, g))

    def close(self) -> None:
        for g in self.groups:
            g.observe_amax(None)

    def _scale_bytes(self) -> torch.Tensor:
        return torch.cat([g.scale_buffers[p] for g, p in self._rows])

    def _observe(self, g: ParamGroup, packed: torch.Tensor) -> None:
        """The group's reduced packed amax ``[row_0, col_0, row_1, col_1, ...]`` (each in its
        scale tensor's row-major order), right after its scales were written: summarised at
        once (a few ops over the group's blocks), so nothing keeps the amax alive."""
        if not self.observing:
            return
        idx = self._index[g.label]
        amax = packed.index_select(0, idx.amax).view(2, -1)
        scales = torch.cat([g.scale_buffers[p] for p in _PLANES]).index_select(0, idx.scales)
        self._headroom[g.label] = _headroom(amax, scales.view(2, -1),
                                            math.log2(_blocks(g).element_max))

    @staticmethod
    def _plane_rows(g: ParamGroup, h: torch.Tensor) -> torch.Tensor:
        """The rows of ``h`` (one per plane of the packed amax) of ``g.planes``."""
        return h if tuple(g.planes) == _PLANES else h[[_PLANES.index(p) for p in g.planes]]

    def _element_counts(self) -> torch.Tensor:
        """int64 (rows, 3): this rank's zero, subnormal and element counts per row."""
        counts = []
        for g, p in self._rows:
            idx = self._index[g.label]
            span = g.model[p][idx.span[0]:idx.span[1]]
            counts += _low_counts(span)
            counts += (self._none, self._none) if idx.gaps is None else _low_counts(
                span.index_select(0, idx.gaps))
        c = torch.stack(counts).view(-1, 2, 2)
        c = c[:, 0] - c[:, 1]  # the span less the padding between pieces
        return torch.stack([c[:, 0], c[:, 1] - c[:, 0], self._local_elements], 1)

    def _scale_counts(self) -> torch.Tensor:
        """int64 (rows, 257): histogram of the scale bytes (padding taken out), changed
        blocks; one histogram over every row, (unchanged, changed) halves per row. Counted by
        sorting the keys and searching the bin edges: exact, no device sync (``bincount``
        reads its max on the host), deterministic (``histc`` on CUDA is not)."""
        cur = self._scale_bytes()
        key = self._bin_base + cur + (cur != self._prev) * 256
        self._prev = cur
        ends = torch.searchsorted(key.sort().values, self._bin_edges)
        hist = ends.diff().view(-1, 2, 256)
        out = torch.cat([hist.sum(1), hist[:, 1].sum(1, keepdim=True)], 1)
        out[:, 0] -= self._scale_padding  # the alignment padding: zero bytes, never changed
        return out

    def collect(self) -> dict[str, dict[str, PlaneTelemetry]]:
        """COLLECTIVE (one all-reduce SUM over the DP group): {group label: {plane: stats}}.
        One device-to-host copy of everything."""
        if not self.groups:
            return {}
        elements = self._element_counts()
        self.model.comms["dp"].all_reduce(elements, Collective.ALL_REDUCE_SUM, Phase.STATE,
                                          "telemetry")
        seen = [g.label in self._headroom for g in self.groups]
        headroom = torch.cat([self._plane_rows(g, self._headroom.get(g.label, self._no_headroom))
                              for g in self.groups])
        self._headroom.clear()
        table = torch.cat([elements.double(), self._scale_counts(), headroom], 1).cpu().tolist()
        out: dict[str, dict[str, PlaneTelemetry]] = {}
        rows = iter(table)
        for g, observed in zip(self.groups, seen, strict=True):
            for p in g.planes:
                r = next(rows)
                counts = [int(c) for c in r[:260]]
                hist, changed, h = counts[3:259], counts[259], r[260:]
                out.setdefault(g.label, {})[p.value] = PlaneTelemetry(
                    scale_exponents={b - E8M0_BIAS: c for b, c in enumerate(hist[:255]) if c},
                    nan_scales=hist[_NAN_SCALE], blocks=sum(hist), changed_blocks=changed,
                    zero=counts[0], subnormal=counts[1], elements=counts[2],
                    headroom=Headroom(int(h[0]), h[1] / h[0] if h[0] else math.nan, h[2], h[3],
                                      int(h[4])) if observed else None,
                )
        return out
