"""docs/extending.md, "A bridge path", performed as the page says, in a scratch copy of the
project: one row added to ``bridge.dtypes.SPECS`` (int16, which Torch and JAX exchange natively
over DLPack, so no transport) and no other change; ``tests/bridge/test_dlpack.py``, whose cases
are the table's rows, then shares int16 buffers both ways and round-trips them, pointers and
bytes equal."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridge import ZeroCopyError, to_jax

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("common", "jax_side", "bridge", "pyproject.toml", "tests/__init__.py",
          "tests/conftest.py", "tests/bridge")
INT8_ROW = "    _spec(torch.int8, jnp.int8),\n"
INT16_ROW = "    _spec(torch.int16, jnp.int16),\n"


def test_a_new_dtype_is_one_row_of_the_bridge_table(tmp_path):
    with pytest.raises(ZeroCopyError, match="torch dtype torch.int16 is not supported"):
        to_jax(torch.zeros(4, dtype=torch.int16))  # not a row today
    for part in COPIED:
        src, dst = ROOT / part, tmp_path / part
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    table = tmp_path / "bridge" / "dtypes.py"
    text = table.read_text()
    assert text.count(INT8_ROW) == 1, "the walkthrough's anchor row moved: update this test"
    table.write_text(text.replace(INT8_ROW, INT8_ROW + INT16_ROW))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(tmp_path),
           "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/bridge/test_dlpack.py", "-k", "int16"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    # to_jax and to_torch on the CPU (CUDA cases skipped here) and the round trip
    assert passed and int(passed.group(1)) >= 3, run.stdout[-2000:]
