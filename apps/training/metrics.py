"""Training metrics as JSON Lines: one strict-JSON object per line, flushed as it is written.

Design note.

- **Records** are flat dicts with a ``"kind"`` (``RecordKind``): ``"run"`` (metadata, usually the
  first line: config, weights, world size, ``loss_floor``, command), ``"step"`` (training loss,
  throughput) and ``"eval"`` (held-out loss). Build them with ``run_record``, ``step_record`` and
  ``eval_record``, which validate the fields.
- **Floats round-trip exactly**: ``json`` writes a float with ``repr`` (the shortest string that
  reads back to the same float64), so every finite float64 and every float32 (widened to float64)
  reads back bit for bit. Numpy scalars are converted to Python numbers first.
- **Non-finite values become ``null``**: NaN and +-Inf are not JSON; rather than write the
  non-standard ``NaN`` token that strict parsers reject, the writer stores ``null`` (a diverged
  loss reads back as ``None``). The file stays strict JSON (``allow_nan=False``), and the reader
  rejects ``NaN``/``Infinity`` tokens too.
- **Resumed runs** open the file with ``append=True``. A crash mid-write can leave a partial last
  line; append mode drops it (it never was a complete record). Steps after the last checkpoint
  are logged again by the resumed run; ``steps``/``evals`` keep the last record of each step.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MetricsWriter",
    "RecordKind",
    "eval_record",
    "evals",
    "read_metrics",
    "run_record",
    "runs",
    "step_record",
    "steps",
]


class RecordKind(enum.Enum):
    """The ``"kind"`` field of a record."""

    RUN = "run"
    STEP = "step"
    EVAL = "eval"


def _to_json_value(value: Any, where: str) -> Any:
    """A JSON-ready copy: numpy scalars/arrays to Python, non-finite floats to None."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, enum.Enum):
        return _to_json_value(value.value, where)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} must be a str (JSON object keys are strings)")
            out[k] = _to_json_value(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [_to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where}={value!r}: {type(value).__name__} is not JSON-serialisable; pass numbers, "
        f"strings, bools, None, lists or dicts of them (e.g. str(path), dataclasses.asdict(cfg))"
    )


class MetricsWriter:
    """Writes records to a JSONL file, one line each, flushed after every record.

    ``MetricsWriter(path)`` truncates (a fresh run); ``append=True`` continues a resumed run's
    file. Parent directories are created. Use as a context manager or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            _drop_partial_last_line(self.path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (a dict with str keys) as one line; non-finite floats -> null."""
        if self._file.closed:
            raise ValueError(f"MetricsWriter({self.path}): write after close")
        if not isinstance(record, dict):
            raise TypeError(
                f"MetricsWriter({self.path}).write: record must be a dict, got "
                f"{type(record).__name__}; build one with step_record/eval_record/run_record"
            )
        line = json.dumps(_to_json_value(record, "record"), allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_partial_last_line(path: Path) -> None:
    """Truncate a last line without its newline (a write cut by a crash)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def _check_step(owner: str, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"{owner}: step={step!r} must be an int >= 0")
    return int(step)


def _check_real(owner: str, name: str, value: object, *, non_negative: bool = False) -> float:
    """A real number as float (NaN/Inf allowed: the writer stores them as null)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{owner}: {name}={value!r} must be a real number (int or float)")
    value = float(value)
    if non_negative and value < 0:
        raise ValueError(f"{owner}: {name}={value} must be >= 0")
    return value


def _with_extra(owner: str, record: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    clash = sorted(set(record) & set(extra))
    if clash:
        raise ValueError(f"{owner}: extra fields {clash} would overwrite the record's own fields")
    return {**record, **extra}


def run_record(**fields: Any) -> dict[str, Any]:
    """Run metadata: ``{"kind": "run", **fields}`` (config, weights, world_size, loss_floor,
    command, ...). ``loss_floor``, when present, is a number or None."""
    if "kind" in fields:
        raise ValueError("run_record: 'kind' is set by run_record itself; drop it from fields")
    if fields.get("loss_floor") is not None:
        fields["loss_floor"] = _check_real("run_record", "loss_floor", fields["loss_floor"])
    return {"kind": RecordKind.RUN.value, **fields}


def step_record(
    *, step: int, loss: float, tokens_per_s: float, step_s: float, **extra: Any
) -> dict[str, Any]:
    """One training step: loss (mean nats/token), throughput and wall time (seconds)."""
    owner = "step_record"
    record = {
        "kind": RecordKind.STEP.value,
        "step": _check_step(owner, step),
        "loss": _check_real(owner, "loss", loss),
        "tokens_per_s": _check_real(owner, "tokens_per_s", tokens_per_s, non_negative=True),
        "step_s": _check_real(owner, "step_s", step_s, non_negative=True),
    }
    return _with_extra(owner, record, extra)


def eval_record(*, step: int, heldout_loss: float, **extra: Any) -> dict[str, Any]:
    """A held-out evaluation after ``step`` steps: mean loss (nats/token) on the held-out set."""
    owner = "eval_record"
    record = {
        "kind": RecordKind.EVAL.value,
        "step": _check_step(owner, step),
        "heldout_loss": _check_real(owner, "heldout_loss", heldout_loss),
    }
    return _with_extra(owner, record, extra)


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name} (the writer stores non-finite as null)")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file, in file order; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_metrics: metrics file {str(path)!r} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                record = json.loads(line, parse_constant=_reject_constant)
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: malformed metrics line: {err}") from None
            except RecursionError:  # the writer nests a few levels (telemetry: 4)
                raise ValueError(f"{path}:{lineno}: malformed metrics line: nested deeper than "
                                 f"the JSON reader can follow; not a record the writer "
                                 f"makes") from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}"
                )
            records.append(record)
    return records


def _of_kind(records: Iterable[dict[str, Any]], kind: RecordKind) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == kind.value]


def _last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_step = {}
    for r in records:
        if not isinstance(r.get("step"), int):
            raise ValueError(f"metrics record {r} has no int 'step'; was it built by *_record?")
        by_step[r["step"]] = r  # a later record of a step wins (resumed runs re-log steps)
    return [by_step[s] for s in sorted(by_step)]


def runs(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``"run"`` records, in file order (a resumed run adds one per start)."""
    return _of_kind(records, RecordKind.RUN)


def steps(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``"step"`` records sorted by step, the last record of each step kept."""
    return _last_per_step(_of_kind(records, RecordKind.STEP))


def evals(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``"eval"`` records sorted by step, the last record of each step kept."""
    return _last_per_step(_of_kind(records, RecordKind.EVAL))
