"""``ByteCorpus``: byte-level text (token = byte value, vocab 256) from a file, a directory tree,
or the Python standard library's own sources, split into train/held-out by ``SplitRule``.
Design note: apps/training/data.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np

from apps.training.corpus import Corpus, Split, check_int, stream_windows

__all__ = ["BYTE_VOCAB", "ByteCorpus", "SplitRule", "TextFiles"]

BYTE_VOCAB = 256  # ByteCorpus: one token per byte value


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
        check_int("SplitRule", "block_bytes", self.block_bytes, minimum=1)
        check_int("SplitRule", "heldout_every", self.heldout_every, minimum=2)

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
        self.seed = check_int("ByteCorpus", "seed", seed, minimum=0)
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
        return stream_windows(data, self.seed, split, ids, window)

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
        seq_len = check_int(f"ByteCorpus({self.name}).check_fits", "seq_len", seq_len, minimum=1)
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
