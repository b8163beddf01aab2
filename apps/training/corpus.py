"""The corpus abstraction: ``Corpus`` (samples addressed by split and global sample id), its
``Split`` and ``Batch``, and the synthetic ``MarkovCorpus``. Design note: apps/training/data.py
(every sample a pure function of (corpus, seed, split, id)); the byte-level text corpus is in
apps/training/byte_corpus.py.
"""

from __future__ import annotations

import abc
import enum
import hashlib
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

__all__ = ["Batch", "Corpus", "MarkovCorpus", "Split", "check_int", "sample_rngs",
           "stream_windows"]


class Split(enum.Enum):
    """Which part of a corpus a sample comes from."""

    TRAIN = "train"
    HELDOUT = "heldout"

    @property
    def seed_tag(self) -> int:
        """The word mixed into each sample's seed: ``default_rng([seed, seed_tag, id])``."""
        return _SPLIT_SEED_TAG[self]


_SPLIT_SEED_TAG = {Split.TRAIN: 0, Split.HELDOUT: 1}


class Batch(NamedTuple):
    """One batch of samples: both int64 (B, seq_len); ``targets[:, t] == tokens[:, t + 1]``."""

    tokens: np.ndarray
    targets: np.ndarray


def check_int(owner: str, name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{owner}: {name}={value!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}: {name}={value} must be >= {minimum}")
    return int(value)


def sample_rngs(seed: int, split: Split, ids: np.ndarray) -> Iterator[np.random.Generator]:
    """One generator per sample id: the only source of randomness of that sample."""
    for i in ids.tolist():
        yield np.random.default_rng([seed, split.seed_tag, i])


def stream_windows(data: np.ndarray, seed: int, split: Split, ids: np.ndarray,
                   window: int) -> np.ndarray:
    """int64 (B, window): sample i is the window of ``data`` (1-D, at least ``window`` long; a
    memory map is read only where sampled) starting at
    ``default_rng([seed, split.seed_tag, i]).integers(0, len(data) - window + 1)``."""
    high = data.size - window + 1  # starts 0 .. n - window
    starts = np.fromiter((rng.integers(0, high) for rng in sample_rngs(seed, split, ids)),
                         dtype=np.int64, count=ids.size)
    views = np.lib.stride_tricks.sliding_window_view(data, window)  # (n - window + 1, window)
    return views[starts].astype(np.int64)


class Corpus(abc.ABC):
    """A token corpus addressed by (split, sample id); subclasses set ``vocab_size`` and ``name``.

    ``batch`` validates its arguments and cuts windows into (tokens, targets); subclasses supply
    the windows (``_windows``), the loss floor and a one-line description.
    """

    vocab_size: int
    name: str

    def batch(self, split: Split, sample_ids: np.ndarray, seq_len: int) -> Batch:
        """The samples ``sample_ids`` (int (B,), each >= 0) of ``split``: int64 (B, seq_len) each.

        A pure function of (corpus, seed, split, ids, seq_len): the same ids give the same bytes.
        """
        owner = f"{type(self).__name__}({self.name}).batch"
        if not isinstance(split, Split):
            raise TypeError(f"{owner}: split={split!r} must be a Split member, e.g. Split.TRAIN")
        seq_len = check_int(owner, "seq_len", seq_len, minimum=1)
        ids = np.asarray(sample_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"{owner}: sample_ids must be a 1-D integer array (B,); got shape {ids.shape} "
                f"dtype {ids.dtype}. Build them with sample_ids(...) or heldout_ids(n)."
            )
        if ids.size and ids.min() < 0:
            raise ValueError(f"{owner}: sample ids must be >= 0; got min {ids.min()}")
        windows = self._windows(split, ids.astype(np.int64), seq_len + 1)  # (B, seq_len + 1)
        assert windows.shape == (ids.size, seq_len + 1) and windows.dtype == np.int64
        return Batch(tokens=windows[:, :-1].copy(), targets=windows[:, 1:].copy())

    @abc.abstractmethod
    def _windows(self, split: Split, ids: np.ndarray, window: int) -> np.ndarray:
        """int64 (B, window) token windows for int64 ids (B,)."""

    @abc.abstractmethod
    def loss_floor(self, seq_len: int) -> float | None:
        """Lowest reachable mean cross-entropy (nats/token) at ``seq_len``; None when unknown."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for logs: name, size in tokens of each split, vocab."""

    @abc.abstractmethod
    def content_digest(self) -> str:
        """``"sha256:<hex>"`` of what the samples are drawn from (not of the ``--data`` string):
        a checkpoint records it and a resume on other data is refused."""

    @abc.abstractmethod
    def check_fits(self, seq_len: int) -> None:
        """Refuse (ValueError), before any training, a corpus that cannot give a sample of
        ``seq_len`` from each split (training and the held-out evaluation)."""


class MarkovCorpus(Corpus):
    """Sequences from a random Markov chain: V tokens, ``branching`` successors each.

    The chain (``transition``, ``loss_floor``) is built from ``default_rng(seed)``, as the
    first version of the demo built it, so seeds keep their corpus; sampling is by id: sample
    ``i`` starts at a uniform token and takes ``seq_len`` inverse-CDF steps, all from
    ``default_rng([seed, split.seed_tag, i])``. Both splits follow the same chain.
    """

    def __init__(self, vocab_size: int, *, branching: int = 4, seed: int = 0):
        vocab_size = check_int("MarkovCorpus", "vocab_size", vocab_size, minimum=1)
        self.seed = check_int("MarkovCorpus", "seed", seed, minimum=0)
        if not 1 <= branching <= vocab_size:
            raise ValueError(
                f"MarkovCorpus: branching={branching} must be in [1, vocab_size={vocab_size}]"
            )
        rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.name = "markov"
        self.branching = branching
        self.transition = np.zeros((vocab_size, vocab_size))  # (V, V) float64, rows sum to 1
        for i in range(vocab_size):
            succ = rng.choice(vocab_size, size=branching, replace=False)
            self.transition[i, succ] = rng.dirichlet(np.ones(branching))
        cdf = np.cumsum(self.transition, axis=1)  # (V, V)
        # The plateau after each row's last successor is exactly 1.0, so a uniform u in [0, 1)
        # never runs past it into a token of probability 0 through rounding of the cumsum.
        cdf[cdf >= cdf[:, -1:]] = 1.0
        self._cdf = cdf

    def _windows(self, split: Split, ids: np.ndarray, window: int) -> np.ndarray:
        n = ids.size
        seq: np.ndarray = np.empty((n, window), np.int64)  # (B, window)
        u = np.empty((n, window - 1))  # (B, window - 1) float64: each row from its own rng
        for row, rng in enumerate(sample_rngs(self.seed, split, ids)):
            seq[row, 0] = rng.integers(0, self.vocab_size)
            u[row] = rng.random(window - 1)
        for t in range(window - 1):
            # token k is drawn when cdf[k - 1] <= u < cdf[k], so p[k] > 0
            seq[:, t + 1] = (self._cdf[seq[:, t]] <= u[:, t : t + 1]).sum(axis=1)
        return seq

    def loss_floor(self, seq_len: int) -> float:
        """Expected cross-entropy (nats/token) of the true conditional distribution.

        Position t's token is distributed as u P^t (u uniform); predicting position t+1 costs
        the entropy of the row of the current token. Averaged over the seq_len predictions.
        """
        seq_len = check_int("MarkovCorpus.loss_floor", "seq_len", seq_len, minimum=1)
        p = self.transition
        with np.errstate(divide="ignore", invalid="ignore"):
            row_entropy = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)  # (V,)
        dist_t = np.full(self.vocab_size, 1.0 / self.vocab_size)
        total = 0.0
        for _ in range(seq_len):
            total += float(dist_t @ row_entropy)
            dist_t = dist_t @ p
        return total / seq_len

    def content_digest(self) -> str:
        """sha256 over the vocabulary size and the (V, V) float64 transition matrix."""
        h = hashlib.sha256(f"markov:{self.vocab_size}:".encode())
        h.update(np.ascontiguousarray(self.transition).tobytes())
        return f"sha256:{h.hexdigest()}"

    def check_fits(self, seq_len: int) -> None:
        """Always fits: samples are generated, of any length."""

    def describe(self) -> str:
        return (
            f"markov (branching={self.branching}, seed={self.seed}): train and heldout "
            f"unbounded (generated per sample id), vocab {self.vocab_size}"
        )
