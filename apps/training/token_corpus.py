"""``TokenCorpus``: tokenized data as nanoGPT writes it -- a directory holding ``train.bin`` and
``val.bin``, each a flat array of uint16 token ids (little-endian, what ``np.uint16`` arrays'
``tofile`` writes; GPT-2's tokenizer has 50257 ids). Design note: apps/training/data.py.

- Splits: ``train.bin`` is the training split, ``val.bin`` the held-out one. Sample ``i`` of a
  split is the window of ``seq_len + 1`` tokens starting at
  ``default_rng([seed, split.seed_tag, i]).integers(0, len(split) - seq_len)`` (as for bytes).
- The files are memory-mapped, never read whole; opening a corpus reads each once, in chunks, to
  check every id against the model's vocabulary (an id >= ``vocab_size`` is refused, naming
  the file, the id, its position and the vocabulary) and to hash it (``content_digest``: sha256
  of both files, about 1 s per GB).
- Other metadata (nanoGPT's ``meta.pkl``) is not read: it is a pickle.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from apps.training.corpus import Corpus, Split, check_int, stream_windows

__all__ = ["TOKEN_DTYPE", "TOKEN_FILES", "TokenCorpus", "is_token_dir"]

TOKEN_DTYPE = np.dtype("<u2")  # nanoGPT: np.uint16 on little-endian machines
TOKEN_FILES = {Split.TRAIN: "train.bin", Split.HELDOUT: "val.bin"}
_CHUNK = 1 << 24  # tokens per chunk of the opening scan (32 MB)


def is_token_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding nanoGPT's ``train.bin`` or ``val.bin`` (a token
    directory: ``TokenCorpus`` refuses one that lacks either, naming it)."""
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in TOKEN_FILES.values())


def _open(path: Path, vocab_size: int) -> tuple[np.ndarray, bytes]:
    """(the memory-mapped ids, the file's sha256 digest); refuses a file that is not whole
    uint16 ids or holds an id outside the vocabulary."""
    size = path.stat().st_size
    if size == 0 or size % TOKEN_DTYPE.itemsize:
        raise ValueError(
            f"token file {str(path)!r} has {size} bytes: expected a non-empty array of uint16 "
            f"token ids (2 bytes each, as nanoGPT's prepare.py writes them)"
        )
    ids: np.ndarray = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    digest = hashlib.sha256()
    for start in range(0, ids.size, _CHUNK):
        chunk = np.asarray(ids[start:start + _CHUNK])
        digest.update(chunk.tobytes())
        top = int(chunk.max())
        if top >= vocab_size:
            at = start + int(np.argmax(chunk >= vocab_size))
            raise ValueError(
                f"token file {str(path)!r} holds token id {int(ids[at])} at position {at:,}, "
                f"but the model's vocabulary has {vocab_size} ids (0..{vocab_size - 1}); pick a "
                f"--config whose vocabulary covers the tokenizer's (GPT-2's 50257 ids: "
                f"gpt2-124m and larger have 50304), or re-tokenize"
            )
    return ids, digest.digest()


class TokenCorpus(Corpus):
    """nanoGPT's ``train.bin`` / ``val.bin`` in ``root`` (module docstring); ``vocab_size``: the
    model's vocabulary, which every id must be below."""

    def __init__(self, root: str | Path, *, vocab_size: int, seed: int = 0):
        self.root = Path(root)
        self.vocab_size = check_int("TokenCorpus", "vocab_size", vocab_size, minimum=1)
        self.seed = check_int("TokenCorpus", "seed", seed, minimum=0)
        self.name = str(self.root)
        missing = [n for n in TOKEN_FILES.values() if not (self.root / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"TokenCorpus: {str(self.root)!r} lacks {missing}; expected a directory holding "
                f"nanoGPT's train.bin and val.bin (uint16 token ids)"
            )
        self._splits: dict[Split, np.ndarray] = {}
        digest = hashlib.sha256(b"nanogpt-uint16-tokens")
        for split, name in TOKEN_FILES.items():
            ids, file_digest = _open(self.root / name, self.vocab_size)
            self._splits[split] = ids
            digest.update(name.encode() + file_digest)
        self._digest = "sha256:" + digest.hexdigest()

    def split_size(self, split: Split) -> int:
        """Tokens in ``split``."""
        return int(self._splits[split].size)

    def _windows(self, split: Split, ids: np.ndarray, window: int) -> np.ndarray:
        data = self._splits[split]
        if data.size < window:
            raise ValueError(
                f"TokenCorpus({self.name}): {TOKEN_FILES[split]} holds {data.size} tokens, but a "
                f"sample of seq_len={window - 1} needs {window}; use a shorter seq_len"
            )
        return stream_windows(data, self.seed, split, ids, window)

    def loss_floor(self, seq_len: int) -> None:
        """Unknown for real text."""
        return None

    def content_digest(self) -> str:
        """sha256 over both files' ids (computed once, when opened)."""
        return self._digest

    def check_fits(self, seq_len: int) -> None:
        seq_len = check_int(f"TokenCorpus({self.name}).check_fits", "seq_len", seq_len,
                            minimum=1)
        short = [f"{TOKEN_FILES[s]} ({self.split_size(s):,} tokens)" for s in Split
                 if self.split_size(s) < seq_len + 1]
        if short:
            raise ValueError(
                f"token corpus {self.name!r} is too small for seq_len={seq_len}: a sample needs "
                f"seq_len + 1 = {seq_len + 1} tokens of each file, and {' and '.join(short)} "
                f"hold fewer; use a shorter --seq-len"
            )

    def describe(self) -> str:
        return (f"{self.name}: nanoGPT tokens, train.bin {self.split_size(Split.TRAIN):,} "
                f"tokens, val.bin {self.split_size(Split.HELDOUT):,} tokens, vocab "
                f"{self.vocab_size}")
