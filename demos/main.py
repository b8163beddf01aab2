"""The README's main job: the hybrid training demo, then nothing else.

    python -m demos.main            # == python -m demos.train --compare

Trains the small GPT twin (``jax_side.models.TINY``) with Torch FSDP (ZeRO-3, 2 gloo CPU ranks)
and JAX MXFP8 GEMMs through the bridge, and the same run with fp32 linear layers as the control,
on a Markov-chain corpus with an exact loss floor; prints both loss curves. See
``python -m demos.train --help`` for options (GPU: ``--device cuda``). The cross-framework
parity report (Torch FSDP vs Flax on the same MXFP8 bytes) is ``python -m demos.parity``
(``make parity``).
"""

from __future__ import annotations

import sys

from demos.train import main as train_main

if __name__ == "__main__":
    raise SystemExit(train_main(["--compare", *sys.argv[1:]]))
