"""Instruments that read a wrapped model without changing it (docs/training.md).

``numerics_telemetry`` (per-plane scale histograms, changed blocks, zero and subnormal counts,
amax headroom), ``step_digest`` (bit-level digests of parameters, gradients and planes, equal
at every world size) and ``rank_share`` (which elements of a group buffer a rank counts, so
sums over ranks count each element once). ``apps.training.instruments`` turns them on from
the command line.
"""
