"""Training corpora whose samples are addressed by a global sample index.

Design note. Every sample is a pure function of (corpus, seed, split, global sample id):

- **sample id**: a non-negative int64. Sample ``i`` of split ``s`` draws all its randomness from
  its own generator, ``np.random.default_rng([seed, s.seed_tag, i])``; no generator state is
  carried from one sample to the next.
- **data position** (``DataPosition``): how many samples all ranks together have consumed. It is
  the only data state a checkpoint needs: resuming from it reproduces the stream bit for bit.
- **step ids** (``sample_ids``): a step starting at position ``p`` with global batch
  ``G = world_size * micro_batches * batch_size`` reads exactly the ids ``p .. p + G - 1``;
  micro-batch ``m`` of rank ``r`` reads the ``batch_size`` ids starting at
  ``p + (m * world_size + r) * batch_size``. The same position therefore means the same data at
  any world size with the same global batch (only the assignment of ids to ranks differs).
- **held-out set** (``heldout_ids``): ids ``0 .. n - 1`` of ``Split.HELDOUT``, the same for every
  run of a seed.

Corpora (all yield ``Batch(tokens, targets)``, int64 (B, seq_len); a sample is a window of
``seq_len + 1`` tokens and targets are tokens shifted by one):

- ``MarkovCorpus`` (apps/training/corpus.py, with the ``Corpus`` base): a seeded random Markov
  chain (the demo's synthetic language) with an exact loss floor; unbounded, generated per
  sample.
- ``TokenCorpus`` (apps/training/token_corpus.py): nanoGPT's tokenized data, a directory with
  ``train.bin`` (train split) and ``val.bin`` (held-out), uint16 token ids (GPT-2's); every id
  is checked against the model's vocabulary when opened. Sample ``i`` is the window starting at
  ``default_rng([seed, s.seed_tag, i]).integers(0, len(split) - seq_len)``.
- ``ByteCorpus`` (apps/training/byte_corpus.py): byte-level text (token = byte value, vocab
  256) from a file, a directory tree, or the Python standard library's own sources.
  Train/held-out split (``SplitRule``): the byte stream is cut into fixed blocks (4096 bytes)
  and every 20th block (block indices 19, 39, ...) goes to held-out; each split is the
  concatenation of its blocks in order. Sample ``i`` is the window starting at
  ``default_rng([seed, s.seed_tag, i]).integers(0, len(split) - seq_len)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from apps.training.byte_corpus import BYTE_VOCAB, ByteCorpus, SplitRule, TextFiles
from apps.training.corpus import Batch, Corpus, MarkovCorpus, Split, check_int
from apps.training.token_corpus import TokenCorpus, is_token_dir

__all__ = [
    "BYTE_VOCAB",
    "Batch",
    "ByteCorpus",
    "Corpus",
    "DataPosition",
    "MarkovCorpus",
    "Split",
    "SplitRule",
    "TextFiles",
    "TokenCorpus",
    "advance",
    "heldout_ids",
    "is_token_dir",
    "make_corpus",
    "sample_ids",
]

CORPUS_SPECS = ("markov", "stdlib", "<a directory with nanoGPT's train.bin and val.bin>",
                "<path to a text file or directory>")  # make_corpus accepts


def make_corpus(spec: str, *, vocab_size: int, seed: int, branching: int = 4) -> Corpus:
    """``"markov"`` -> MarkovCorpus(vocab_size, branching=branching); ``"stdlib"`` ->
    ByteCorpus.from_stdlib; a directory holding ``train.bin`` and ``val.bin`` -> TokenCorpus
    (its ids checked against ``vocab_size``); any other string is a path ->
    ByteCorpus.from_path. ``vocab_size`` is the model's vocabulary: byte corpora need at least
    256."""
    if spec == "markov":
        return MarkovCorpus(vocab_size, branching=branching, seed=seed)
    if spec != "stdlib" and not Path(spec).exists():
        raise FileNotFoundError(
            f"make_corpus: corpus {spec!r} is neither a known name nor an existing path; "
            f"expected one of {list(CORPUS_SPECS)}"
        )
    if spec != "stdlib" and is_token_dir(spec):
        return TokenCorpus(spec, vocab_size=vocab_size, seed=seed)
    if vocab_size < BYTE_VOCAB:
        raise ValueError(
            f"make_corpus: byte corpus {spec!r} has {BYTE_VOCAB} tokens but the model's "
            f"vocab_size={vocab_size}; pick a config with vocab_size >= {BYTE_VOCAB} or 'markov'"
        )
    if spec == "stdlib":
        return ByteCorpus.from_stdlib(seed=seed)
    return ByteCorpus.from_path(spec, seed=seed)


def _check_plain_int(owner: str, name: str, value: object) -> None:
    # A plain int (not bool, not a numpy scalar): what to_dict writes and a checkpoint keeps.
    if type(value) is not int:
        raise TypeError(
            f"{owner}: {name}={value!r} must be a plain int, got {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(f"{owner}: {name}={value} must be >= 0")


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: samples consumed so far by all ranks together.

    The data part of a checkpoint; ``to_dict`` holds ints only (JSON- and weights_only-safe).
    """

    samples_consumed: int = 0

    def __post_init__(self) -> None:
        _check_plain_int("DataPosition", "samples_consumed", self.samples_consumed)

    def to_dict(self) -> dict[str, int]:
        return {"samples_consumed": self.samples_consumed}

    @classmethod
    def from_dict(cls, state: object) -> DataPosition:
        """Inverse of ``to_dict``; rejects missing, extra, non-int or negative entries."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"DataPosition.from_dict: expected a mapping like {{'samples_consumed': 0}}, "
                f"got {type(state).__name__}"
            )
        expected = {f.name for f in dataclasses.fields(cls)}
        if set(state) != expected:
            raise ValueError(
                f"DataPosition.from_dict: keys {sorted(map(str, state))} != expected "
                f"{sorted(expected)}; was this saved by DataPosition.to_dict?"
            )
        values: dict[str, Any] = {k: state[k] for k in expected}  # checked by __post_init__
        return cls(**values)


def _global_batch(world_size: int, micro_batches: int, batch_size: int) -> int:
    world_size = check_int("data position", "world_size", world_size, minimum=1)
    micro_batches = check_int("data position", "micro_batches", micro_batches, minimum=1)
    batch_size = check_int("data position", "batch_size", batch_size, minimum=1)
    return world_size * micro_batches * batch_size


def sample_ids(
    position: DataPosition,
    *,
    rank: int,
    world_size: int,
    micro_batch: int,
    micro_batches: int,
    batch_size: int,
) -> np.ndarray:
    """int64 (batch_size,): the ids ``rank`` reads for ``micro_batch`` of the step at ``position``.

    ``position.samples_consumed + (micro_batch * world_size + rank) * batch_size + arange(B)``:
    over all ranks and micro-batches a step reads one contiguous range with no overlap.
    """
    _global_batch(world_size, micro_batches, batch_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"sample_ids: rank={rank} must be in [0, world_size={world_size})")
    if not 0 <= micro_batch < micro_batches:
        raise ValueError(
            f"sample_ids: micro_batch={micro_batch} must be in [0, micro_batches={micro_batches})"
        )
    first = position.samples_consumed + (micro_batch * world_size + rank) * batch_size
    return first + np.arange(batch_size, dtype=np.int64)


def advance(
    position: DataPosition, *, world_size: int, micro_batches: int, batch_size: int
) -> DataPosition:
    """The position after one step: ``world_size * micro_batches * batch_size`` samples on."""
    step = _global_batch(world_size, micro_batches, batch_size)
    return DataPosition(position.samples_consumed + step)


def heldout_ids(n: int) -> np.ndarray:
    """int64 (n,): ids 0 .. n - 1 of ``Split.HELDOUT``, the fixed held-out set of every run."""
    n = check_int("heldout_ids", "n", n, minimum=1)
    return np.arange(n, dtype=np.int64)
