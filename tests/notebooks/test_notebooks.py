"""Every notebook in notebooks/ executes top to bottom on CPU with no error output and shows its
plots (at least one image/png output each).

Notebooks are kept without outputs in git; this runs them in a fresh kernel (the venv's
ipykernel) with the repository root importable, exactly as a user opening them would.
"""

from __future__ import annotations

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="install the [notebooks] extra")
nbclient = pytest.importorskip("nbclient", reason="install the [notebooks] extra")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.usefixtures("children_share_jax_cache")  # the notebooks' ranks share their programs
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # Opt in to platformdirs paths: silences jupyter_core's path-migration DeprecationWarning.
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    plots = [o for o in outputs if "image/png" in o.get("data", {})]
    assert plots, f"{path.name}: executed, but no cell displayed a plot (image/png output)"


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert names >= {"mxfp8_numerics.ipynb", "fsdp_buffers.ipynb", "parity.ipynb",
                     "training.ipynb"}, names
