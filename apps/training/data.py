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

- ``MarkovCorpus``: a seeded random Markov chain (the demo's synthetic language) with an
  exact loss floor; unbounded, generated per sample.
- ``ByteCorpus``: byte-level text (token = byte value, vocab 256) from a file, a directory tree,
  or the Python standard library's own sources. Train/held-out split (``SplitRule``): the byte
  stream is cut into fixed blocks (4096 bytes) and every 20th block (block indices 19, 39, ...)
  goes to held-out; each split is the concatenation of its blocks in order. Sample ``i`` is the
  window starting at ``default_rng([seed, s.seed_tag, i]).integers(0, len(split) - seq_len)``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import hashlib
import os
import stat
import sysconfig
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = [
    "Batch",
    "ByteCorpus",
    "Corpus",
    "DataPosition",
    "MarkovCorpus",
    "Split",
    "SplitRule",
    "TextFiles",
    "advance",
    "heldout_ids",
    "make_corpus",
    "sample_ids",
]

BYTE_VOCAB = 256  # ByteCorpus: one token per byte value
CORPUS_SPECS = ("markov", "stdlib", "<path to a text file or directory>")  # make_corpus accepts


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


def _check_int(owner: str, name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{owner}: {name}={value!r} must be an int (got {type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}: {name}={value} must be >= {minimum}")
    return int(value)


def _sample_rngs(seed: int, split: Split, ids: np.ndarray) -> Iterator[np.random.Generator]:
    """One generator per sample id: the only source of randomness of that sample."""
    for i in ids.tolist():
        yield np.random.default_rng([seed, split.seed_tag, i])


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
        seq_len = _check_int(owner, "seq_len", seq_len, minimum=1)
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
        vocab_size = _check_int("MarkovCorpus", "vocab_size", vocab_size, minimum=1)
        self.seed = _check_int("MarkovCorpus", "seed", seed, minimum=0)
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
        seq = np.empty((n, window), np.int64)  # (B, window)
        u = np.empty((n, window - 1))  # (B, window - 1) float64: each row from its own rng
        for row, rng in enumerate(_sample_rngs(self.seed, split, ids)):
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
        seq_len = _check_int("MarkovCorpus.loss_floor", "seq_len", seq_len, minimum=1)
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


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """Train/held-out split of a byte stream: every ``heldout_every``-th block is held out.

    The stream is cut into blocks of ``block_bytes``; block k (from 0) is held out when
    ``k % heldout_every == heldout_every - 1`` (blocks 19, 39, ... by default). The last block
    may be short. Each split is the concatenation, in order, of its blocks.
    """

    block_bytes: int = 4096
    heldout_every: int = 20

    def __post_init__(self) -> None:
        _check_int("SplitRule", "block_bytes", self.block_bytes, minimum=1)
        _check_int("SplitRule", "heldout_every", self.heldout_every, minimum=2)

    def split_sizes(self, n: int) -> dict[Split, int]:
        """Bytes of each split of an ``n``-byte stream (what ``split`` gives, counted)."""
        b, every = self.block_bytes, self.heldout_every
        n_full = n // b
        held = (n_full // every) * b  # full blocks k < n_full with k % every == every - 1
        if n_full % every == every - 1:
            held += n - n_full * b  # the short last block is a held-out one
        return {Split.TRAIN: n - held, Split.HELDOUT: held}

    def min_stream_bytes(self, window: int) -> int:
        """The shortest stream whose splits both hold ``window`` bytes (one sample each)."""
        lo, hi = window, 2 * window * self.heldout_every + self.block_bytes * self.heldout_every
        while lo < hi:  # split sizes grow with n: binary search for the first n that fits
            mid = (lo + hi) // 2
            if min(self.split_sizes(mid).values()) >= window:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def split(self, stream: np.ndarray) -> dict[Split, np.ndarray]:
        """uint8 (N,) -> {Split: uint8 (n_split,)}; the two parts hold every byte exactly once."""
        b = self.block_bytes
        n_full = stream.size // b
        held = np.arange(n_full) % self.heldout_every == self.heldout_every - 1  # (n_full,)
        blocks = stream[: n_full * b].reshape(n_full, b)  # (n_full, block_bytes)
        tail = stream[n_full * b :]  # the short last block, index n_full
        tail_held = n_full % self.heldout_every == self.heldout_every - 1
        parts = {
            Split.TRAIN: [blocks[~held].reshape(-1)],
            Split.HELDOUT: [blocks[held].reshape(-1)],
        }
        parts[Split.HELDOUT if tail_held else Split.TRAIN].append(tail)
        return {s: np.concatenate(p) for s, p in parts.items()}


class TextFiles(NamedTuple):
    """Text read from disk: the concatenated UTF-8 documents and what was read or skipped."""

    data: bytes
    files: int  # documents concatenated into data
    skipped_binary: int  # regular files that did not decode as UTF-8


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _read_text_files(
    root: Path, *, suffix: str | None = None, exclude_dirs: frozenset[str] = frozenset()
) -> TextFiles:
    """Regular files under ``root`` (or ``root`` itself), sorted by relative path.

    Hidden entries (names starting with '.', e.g. .git, .venv) and symbolic links are not read;
    files that do not decode as UTF-8 are skipped and counted.
    """
    if root.is_file():
        paths = [root]
    else:
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):  # does not follow directory links
            dirnames[:] = [d for d in dirnames if d not in exclude_dirs and not _is_hidden(d)]
            for f in filenames:
                if _is_hidden(f) or (suffix is not None and not f.endswith(suffix)):
                    continue
                p = Path(dirpath, f)
                if stat.S_ISREG(p.lstat().st_mode):
                    paths.append(p)
        paths.sort(key=lambda p: p.relative_to(root).parts)
    docs, skipped = [], 0
    for p in paths:
        raw = p.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        docs.append(raw)
    return TextFiles(data=b"".join(docs), files=len(docs), skipped_binary=skipped)


class ByteCorpus(Corpus):
    """Byte-level text: token = byte value (vocab 256), split into train/held-out by ``rule``.

    Sample ``i`` of a split is the window of ``seq_len + 1`` bytes starting at
    ``default_rng([seed, split.seed_tag, i]).integers(0, len(split) - seq_len)``. Windows may
    cross document and block boundaries (documents are concatenated without separators).
    """

    def __init__(self, text: TextFiles, *, name: str, seed: int = 0, rule: SplitRule = SplitRule()):
        self.seed = _check_int("ByteCorpus", "seed", seed, minimum=0)
        self.vocab_size = BYTE_VOCAB
        self.name = name
        self.files = text.files
        self.skipped_binary = text.skipped_binary
        self.rule = rule
        self._splits = rule.split(np.frombuffer(text.data, dtype=np.uint8))
        # the whole byte stream (the documents as read, concatenated) and the split rule
        h = hashlib.sha256(f"bytes:{rule.block_bytes}:{rule.heldout_every}:".encode())
        h.update(text.data)
        self._digest = f"sha256:{h.hexdigest()}"

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, seed: int = 0) -> ByteCorpus:
        """A UTF-8 text file, or a directory read recursively (files sorted by relative path,
        component by component; binary files skipped and counted; hidden entries not read)."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(
                f"ByteCorpus.from_path: {str(root)!r} does not exist; pass a UTF-8 text file or "
                f"a directory of text files"
            )
        text = _read_text_files(root)
        if text.files == 0:
            raise ValueError(
                f"ByteCorpus.from_path: no UTF-8 text files found in {str(root)!r} "
                f"({text.skipped_binary} binary files skipped); pass a text file or a directory "
                f"that holds some"
            )
        return cls(text, name=str(root), seed=seed)

    @classmethod
    def from_stdlib(cls, *, seed: int = 0) -> ByteCorpus:
        """The ``.py`` sources of this Python's standard library (tens of MB, no download);
        ``site-packages``, ``dist-packages`` and ``__pycache__`` are excluded."""
        root = Path(sysconfig.get_paths()["stdlib"])
        excluded = frozenset({"site-packages", "dist-packages", "__pycache__"})
        text = _read_text_files(root, suffix=".py", exclude_dirs=excluded)
        if text.files == 0:
            raise ValueError(
                f"ByteCorpus.from_stdlib: no .py files found under {str(root)!r}; this Python "
                f"ships without its sources. Pass a path or 'markov' instead."
            )
        return cls(text, name="stdlib", seed=seed)

    def split_size(self, split: Split) -> int:
        """Bytes (= tokens) in ``split``."""
        return int(self._splits[split].size)

    def _windows(self, split: Split, ids: np.ndarray, window: int) -> np.ndarray:
        data = self._splits[split]  # uint8 (n_split,)
        if data.size < window:
            raise ValueError(
                f"ByteCorpus({self.name}): the {split.value} split holds {data.size} bytes, but a "
                f"sample of seq_len={window - 1} needs seq_len + 1 = {window} bytes; use a "
                f"shorter seq_len or a larger corpus"
            )
        high = data.size - window + 1  # starts 0 .. n - window
        starts = np.fromiter(
            (rng.integers(0, high) for rng in _sample_rngs(self.seed, split, ids)),
            dtype=np.int64,
            count=ids.size,
        )
        views = np.lib.stride_tricks.sliding_window_view(data, window)  # (n - window + 1, window)
        return views[starts].astype(np.int64)

    def loss_floor(self, seq_len: int) -> None:
        """Unknown for real text."""
        return None

    def content_digest(self) -> str:
        """sha256 over the split rule and the byte stream (computed once, when read)."""
        return self._digest

    def check_fits(self, seq_len: int) -> None:
        """Both splits must hold a window of ``seq_len + 1`` bytes. Windows are drawn with
        replacement, so the batch size and step count need no more; a text under
        ``rule.min_stream_bytes`` (about 78 kB at the default split) has no held-out window."""
        seq_len = _check_int(f"ByteCorpus({self.name}).check_fits", "seq_len", seq_len, minimum=1)
        window = seq_len + 1
        short = [s for s in Split if self.split_size(s) < window]
        if not short:
            return
        total = sum(self.split_size(s) for s in Split)
        sizes = ", ".join(f"{s.value} {self.split_size(s):,}" for s in Split)
        raise ValueError(
            f"corpus {self.name!r} is too small for seq_len={seq_len}: its {total:,} bytes split "
            f"into {sizes} bytes (every {self.rule.heldout_every}th {self.rule.block_bytes}-byte "
            f"block is held out), but a sample needs seq_len + 1 = {window} bytes of each split "
            f"({' and '.join(s.value for s in short)} short); give a text of at least "
            f"{self.rule.min_stream_bytes(window):,} bytes"
        )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.files} files ({self.skipped_binary} binary skipped), "
            f"train {self.split_size(Split.TRAIN):,} bytes, heldout "
            f"{self.split_size(Split.HELDOUT):,} bytes (every {self.rule.heldout_every}th "
            f"{self.rule.block_bytes}-byte block), vocab {self.vocab_size}"
        )


def make_corpus(spec: str, *, vocab_size: int, seed: int) -> Corpus:
    """``"markov"`` -> MarkovCorpus(vocab_size); ``"stdlib"`` -> ByteCorpus.from_stdlib; any
    other string is a path -> ByteCorpus.from_path. ``vocab_size`` is the model's vocabulary:
    byte corpora need at least 256."""
    if spec == "markov":
        return MarkovCorpus(vocab_size, seed=seed)
    if spec != "stdlib" and not Path(spec).exists():
        raise FileNotFoundError(
            f"make_corpus: corpus {spec!r} is neither a known name nor an existing path; "
            f"expected one of {list(CORPUS_SPECS)}"
        )
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
    def from_dict(cls, state: Mapping[str, object]) -> DataPosition:
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
        return cls(**{k: state[k] for k in expected})


def _global_batch(world_size: int, micro_batches: int, batch_size: int) -> int:
    world_size = _check_int("data position", "world_size", world_size, minimum=1)
    micro_batches = _check_int("data position", "micro_batches", micro_batches, minimum=1)
    batch_size = _check_int("data position", "batch_size", batch_size, minimum=1)
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
    n = _check_int("heldout_ids", "n", n, minimum=1)
    return np.arange(n, dtype=np.int64)
