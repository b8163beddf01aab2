"""Counting XLA compilations in a test process (a ``jax.monitoring`` listener, registered once).

``COMPILES.count`` is the number of backend compilations so far; tests compare it before and
after the code whose compilations they count.
"""

from __future__ import annotations

import jax


class _Compiles:
    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kw):
        if event.endswith("backend_compile_duration"):
            self.count += 1


COMPILES = _Compiles()
jax.monitoring.register_event_duration_secs_listener(COMPILES)
