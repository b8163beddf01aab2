"""The README's main job: the cross-framework parity report.

    python -m demos.main

Runs the small GPT twin (``jax_side.models.TINY``) with MXFP8 linear weights under ``torch_side``
FSDP (ZeRO-3) on 2 gloo CPU ranks, and the Flax twin on the very MXFP8 planes and fp32 weights
FSDP all-gathered (imported zero-copy through the bridge); prints the per-layer report. The same
as ``python -m demos.parity`` with its defaults (see there for options).
"""

from __future__ import annotations

from demos.parity import main as parity_main

if __name__ == "__main__":
    raise SystemExit(parity_main([]))
