"""The collective-consistency check: before each FSDP collective, the ranks compare what they are
about to do, so that a divergence is an error naming the unit instead of a crash or a hang.

Why: every rank of a process group must issue the same collectives in the same order. When they
do not -- typically an FSDP unit whose module the model code skips on some ranks (a declared
expert unit is the exception: ``torch_side.fsdp.expert_units`` keeps it in step) -- gloo pairs
buffers of different sizes and aborts the process ("Received data size doesn't match expected
size"), or pairs buffers of equal sizes and silently mixes different tensors; NCCL hangs until
the process group's timeout or corrupts. None of these names the unit.

How (``Communicator`` calls :func:`check_descriptors` before each collective when the check is
on): every rank encodes a :class:`Descriptor` of the collective it is about to run -- which
communicator (its construction ordinal on the process group), how many collectives that
communicator issued before (its sequence number), the operation, phase, label (which starts
with the unit's name), dtype and element count -- as ``DESCRIPTOR_INTS`` int64 values, and the
ranks all-gather them on the same process group. The descriptor's size is fixed, so ranks that
are about to run different collectives still pair up in this all-gather; each then holds every
rank's descriptor and, if they differ, raises :class:`CollectiveMismatchError` on every rank,
naming what each rank was about to do. The cost is one small blocking all-gather (and, on a GPU,
a host synchronisation) per collective: a debug switch, off by default (docs/fsdp.md, "Checking
that ranks issue the same collectives", has the measured cost).

The switch: ``fully_shard(..., check_collectives=True)``; the applications set it from the
environment variable ``CHECK_ENV`` (``MXFP8_FSDP_CHECK_COLLECTIVES=1``, read by
``apps.environment``; the library reads no environment). Every rank must agree: ``Communicator``
all-reduces the switch before its first collective, so one rank asking turns it on for all.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import torch

__all__ = [
    "CHECK_ENV",
    "DESCRIPTOR_INTS",
    "CollectiveMismatchError",
    "Descriptor",

    "mismatch_message",
]

CHECK_ENV = "MXFP8_FSDP_CHECK_COLLECTIVES"  # the applications' name for the switch (messages)
# (apps.environment.CHECK_COLLECTIVES is this name: tests/apps/test_environment.py)
_MAGIC = 0x4D58_4653_4450_0001  # "MXFSDP" + protocol version 1: a row not written by this code
_HEADER = 5  # magic, ordinal, seq, numel, hash of the text
_TEXT_BYTES = 160  # verb, phase, dtype and label, UTF-8 (the label shortened in the middle)
DESCRIPTOR_INTS = _HEADER + _TEXT_BYTES // 8
_SEP = "\x1f"



class CollectiveMismatchError(RuntimeError):
    """The ranks of a process group were about to run different FSDP collectives."""


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """One rank's next collective on one communicator."""

    ordinal: int  # which FSDP communicator on this process group (construction order)
    seq: int  # collectives this communicator issued before this one
    verb: str  # "all-gather", "reduce-scatter", "all-reduce (sum)", "all-reduce (max)"
    phase: str  # collectives.Phase value
    label: str  # "<unit>/<format>/<dp group>/<what>" (wire log label)
    dtype: str  # e.g. "uint8"
    numel: int  # elements of the full tensor

    @property
    def unit(self) -> str:
        return self.label.split("/", 1)[0]

    def encode(self) -> torch.Tensor:
        """(DESCRIPTOR_INTS,) int64 on the CPU."""
        text_hash, text_ints = _encode_text(
            _SEP.join((self.verb, self.phase, self.dtype, self.label))
        )
        head = torch.tensor(
            [_MAGIC, self.ordinal, self.seq, self.numel, text_hash], dtype=torch.int64
        )
        return torch.cat([head, text_ints])

    @staticmethod
    def decode(row: torch.Tensor) -> Descriptor | None:
        """The descriptor in an encoded row; None if the row was not written by ``encode``."""
        ints = [int(v) for v in row[:_HEADER]]
        if ints[0] != _MAGIC:
            return None
        raw = row[_HEADER:].contiguous().numpy().tobytes().rstrip(b"\0")
        parts = raw.decode("utf-8", errors="replace").split(_SEP, 3)
        if len(parts) != 4:
            return None
        verb, phase, dtype, label = parts
        return Descriptor(ints[1], ints[2], verb, phase, label, dtype, ints[3])

    def describe(self) -> str:
        return (
            f"{self.verb} of {self.label!r} (unit {self.unit!r}, {self.phase}; {self.numel} x "
            f"{self.dtype}; collective #{self.seq} of FSDP communicator #{self.ordinal})"
        )


@functools.lru_cache(maxsize=4096)  # a model has a few labels per unit; they repeat every step
def _encode_text(text: str) -> tuple[int, torch.Tensor]:
    """(stable hash of the whole text, its bytes as int64s; a long label shortened in the
    middle). blake2b, not hash(): Python salts hash() per process."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    raw = text.encode()
    if len(raw) > _TEXT_BYTES:  # keep the unit (head) and the plane (tail) of a long label
        keep = _TEXT_BYTES - 3
        raw = raw[: keep // 2] + b"..." + raw[len(raw) - (keep - keep // 2) :]
    buf = bytearray(_TEXT_BYTES)
    buf[: len(raw)] = raw
    return int.from_bytes(digest, "little", signed=True), torch.frombuffer(buf, dtype=torch.int64)


def mismatch_message(rows: torch.Tensor, rank: int, group_name: str) -> str | None:
    """None when every rank's row (``rows``: (world, DESCRIPTOR_INTS) int64, CPU) is the same;
    else the error text naming what each rank was about to do, the likely cause and the fix."""
    if bool((rows == rows[0]).all()):
        return None
    decoded = [Descriptor.decode(r) for r in rows]
    lines: list[str] = []
    ranks_of: dict[str, list[int]] = {}
    for r, d in enumerate(decoded):
        key = d.describe() if d is not None else "something else (not an FSDP descriptor)"
        ranks_of.setdefault(key, []).append(r)
    for what, ranks in ranks_of.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"  {who}: {what}")
    units = sorted({d.unit for d in decoded if d is not None})
    ordinals = sorted({d.ordinal for d in decoded if d is not None})
    models = (
        f" The ranks are in different FSDP models' collectives (communicators "
        f"{', '.join(f'#{o}' for o in ordinals)}): call the same wrapped model on every rank."
        if len(ordinals) > 1 else ""
    )
    return (
        f"rank {rank}: FSDP collective mismatch on process group {group_name!r} (found by "
        f"check_collectives / {CHECK_ENV}=1): the ranks are about to run different "
        f"collectives:\n" + "\n".join(lines) + "\n"
        f"Likely cause: an FSDP unit ran on some ranks only (units involved: "
        f"{', '.join(repr(u) for u in units)}) -- model code that skips a module listed in "
        f"unit_modules on some ranks (data-dependent control flow, layer drop, a router that "
        f"sends no tokens to an expert wrapped as its own unit but not declared an expert), or "
        f"a forward, backward or state-dict call made on some ranks only. Fix: run every FSDP "
        f"unit on every rank in every iteration (call it with an empty input where it has "
        f"nothing to do); declare experts, fully_shard(..., expert_modules=..., "
        f"expert_group=...), and an expert unit's enclosing unit keeps every rank's "
        f"collectives in step; or make the skipped module part of an enclosing unit (list its "
        f"parent in unit_modules instead).{models}"
    )
