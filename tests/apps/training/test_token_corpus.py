"""nanoGPT's tokenized data (``--data DIR`` with ``train.bin`` and ``val.bin``, uint16 ids):
``apps.training.token_corpus.TokenCorpus``.

- A sample is a window of the file (train.bin for training, val.bin held out), a pure function
  of (seed, split, id); targets are tokens shifted by one.
- Every id is checked against the model's vocabulary when the corpus opens: an id outside it,
  a file that is not whole uint16 ids, a directory that lacks one of the files, or files too
  small for ``seq_len`` are refused with the file named -- also by ``mxfp8-train`` before any
  rank starts.
- The training app trains on it (one rank, in this process), and a checkpoint records the
  files' digest (a changed token changes it).
"""

from __future__ import annotations

import numpy as np
import pytest

from apps.training import cli
from apps.training.data import Split, TokenCorpus, heldout_ids, make_corpus
from apps.training.job import TrainJob
from apps.training.loop import RunOptions, train_rank
from tests.torch_side.threaded_world import run_ranks


def _write(root, train, val):
    root.mkdir(parents=True, exist_ok=True)
    np.asarray(train, np.uint16).tofile(root / "train.bin")
    np.asarray(val, np.uint16).tofile(root / "val.bin")
    return root


@pytest.fixture
def tokens(tmp_path):
    rng = np.random.default_rng(0)
    return _write(tmp_path / "tok", rng.integers(0, 128, 5000), rng.integers(0, 128, 700))


def test_a_token_directory_gives_windows_of_its_files(tokens):
    corpus = make_corpus(str(tokens), vocab_size=128, seed=3)
    assert isinstance(corpus, TokenCorpus) and corpus.vocab_size == 128
    train = np.fromfile(tokens / "train.bin", np.uint16).astype(np.int64)
    val = np.fromfile(tokens / "val.bin", np.uint16).astype(np.int64)
    b = corpus.batch(Split.TRAIN, np.arange(6), 32)
    assert b.tokens.shape == (6, 32) and b.tokens.dtype == np.int64
    assert np.array_equal(b.tokens[:, 1:], b.targets[:, :-1])
    for row, target in zip(b.tokens, b.targets, strict=True):
        window = np.concatenate([row, target[-1:]])
        starts = [s for s in range(train.size - 32) if np.array_equal(train[s:s + 33], window)]
        assert starts, "every sample is a window of train.bin"
    h = corpus.batch(Split.HELDOUT, heldout_ids(2), 16)
    assert all(any(np.array_equal(val[s:s + 16], r) for s in range(val.size - 16))
               for r in h.tokens)
    again = make_corpus(str(tokens), vocab_size=128, seed=3).batch(Split.TRAIN, np.arange(6), 32)
    assert np.array_equal(again.tokens, b.tokens)  # a pure function of (seed, split, ids)
    assert "train.bin 5,000 tokens, val.bin 700 tokens, vocab 128" in corpus.describe()


def test_an_id_outside_the_vocabulary_is_refused_naming_file_id_and_position(tmp_path):
    root = _write(tmp_path / "gpt2", [1, 2, 50256, 3], [1, 2])
    with pytest.raises(ValueError, match=r"train.bin' holds token id 50256 at position 2, but "
                                         r"the model's vocabulary has 128 ids"):
        make_corpus(str(root), vocab_size=128, seed=0)
    assert make_corpus(str(root), vocab_size=50304, seed=0).vocab_size == 50304


def test_broken_token_files_are_refused_by_name(tmp_path):
    odd = _write(tmp_path / "odd", [1, 2, 3], [1, 2])
    with open(odd / "val.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError, match=r"val.bin' has 5 bytes: expected a non-empty array of "
                                         r"uint16 token ids"):
        make_corpus(str(odd), vocab_size=128, seed=0)
    half = tmp_path / "half"
    half.mkdir()
    np.asarray([1, 2], np.uint16).tofile(half / "train.bin")
    with pytest.raises(FileNotFoundError, match=r"lacks \['val.bin'\]"):
        make_corpus(str(half), vocab_size=128, seed=0)
    small = make_corpus(str(_write(tmp_path / "small", range(100), range(10))), vocab_size=128,
                        seed=0)
    with pytest.raises(ValueError, match=r"too small for seq_len=32: .* val.bin \(10 tokens\)"):
        small.check_fits(32)


def test_the_digest_follows_the_tokens(tmp_path):
    a = make_corpus(str(_write(tmp_path / "a", range(100), range(50))), vocab_size=128, seed=0)
    b = make_corpus(str(_write(tmp_path / "b", [*range(99), 7], range(50))), vocab_size=128,
                    seed=0)
    assert a.content_digest().startswith("sha256:") and a.content_digest() != b.content_digest()


def test_mxfp8_train_refuses_tokens_outside_the_configs_vocabulary_before_training(
        tmp_path, capsys):
    root = _write(tmp_path / "gpt2", [5, 50256, 7] * 100, [5, 6, 7] * 50)
    assert cli.main(["--data", str(root), "--config", "tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds token id 50256 at position 1" in err and "has 128 ids" in err, err


def test_the_training_app_trains_on_token_files(tokens):
    job = TrainJob(data=str(tokens), config="tiny", steps=3, micro_batches=1, batch_size=4,
                   seq_len=32, lr=1e-2, seed=1, eval_batches=1)
    (result,) = run_ranks(train_rank, 1, (job, RunOptions(progress=False, precompile=False)))
    assert len(result.steps) == 3 and np.isfinite(result.heldout_loss)
    assert result.initial_loss == pytest.approx(np.log(128), rel=0.05)  # vocab: the preset's
