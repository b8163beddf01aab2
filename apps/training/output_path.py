"""Can a file be written at a path? Asked by the command lines before the work whose result
goes there (a training run, a figure), so that a bad path fails at once, not after the work.

Every writer of the training app creates missing parent directories (metrics, plots, traces),
so a path is writable when it is not a directory, and the nearest existing ancestor of its file
is a directory this process may create files in. Nothing is written to find out.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["unwritable_reason"]


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why no file can be written at ``path``, as a clause naming it (None: it can, as far as
    can be told without writing)."""
    p = Path(os.path.abspath(path))
    if p.is_dir():
        return f"{str(path)!r} is an existing directory; give the path of a file"
    if p.exists():
        return None if os.access(p, os.W_OK) else f"{str(path)!r} exists and is not writable"
    ancestor = p.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{str(ancestor)!r} is a file, so {str(path)!r} cannot be created under it"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"no permission to create {str(path)!r} in {str(ancestor)!r}"
    return None
