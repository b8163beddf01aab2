"""Corpora addressed by global sample index: determinism, the Markov floor, the byte split and
the sample-id scheme (apps/training/data.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.training.data import (
    ByteCorpus,
    DataPosition,
    MarkovCorpus,
    Split,
    SplitRule,
    TextFiles,
    advance,
    heldout_ids,
    make_corpus,
    sample_ids,
)

# --- Markov -----------------------------------------------------------------------------------


def test_markov_batch_is_a_pure_function_of_split_and_ids():
    corpus = MarkovCorpus(64, seed=5)
    ids = np.array([3, 17, 1000, 4], np.int64)
    a = corpus.batch(Split.TRAIN, ids, 12)
    b = MarkovCorpus(64, seed=5).batch(Split.TRAIN, ids, 12)  # a fresh object, same seed
    assert a.tokens.dtype == a.targets.dtype == np.int64 and a.tokens.shape == (4, 12)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.targets, b.targets)
    # a sample does not depend on the batch it is in, nor on its row
    one = corpus.batch(Split.TRAIN, ids[2:3], 12)
    np.testing.assert_array_equal(one.tokens[0], a.tokens[2])
    # other ids, the other split and another seed give other samples
    assert not np.array_equal(corpus.batch(Split.TRAIN, ids + 1, 12).tokens, a.tokens)
    assert not np.array_equal(corpus.batch(Split.HELDOUT, ids, 12).tokens, a.tokens)
    assert not np.array_equal(MarkovCorpus(64, seed=6).batch(Split.TRAIN, ids, 12).tokens, a.tokens)


def test_markov_samples_follow_the_chain_and_the_floor_is_the_mean_true_nll():
    corpus = MarkovCorpus(32, branching=3, seed=1)
    tokens, targets = corpus.batch(Split.TRAIN, np.arange(2000), 16)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # targets shifted by one
    p = corpus.transition[tokens, targets]
    assert np.all(p > 0), "a sampled transition has probability 0"
    nll = -np.log(p).mean()
    # 32,000 samples of a quantity with std < 1.2: the floor is within ~4 standard errors
    assert abs(nll - corpus.loss_floor(16)) < 4 * 1.2 / math.sqrt(p.size)
    # start tokens are uniform: every token starts some of 2000 samples over 32 tokens
    assert np.unique(tokens[:, 0]).size == 32


# Loss floors of the prototype's corpus (same chain construction), computed before it was replaced
# by this module: the demo's "exact floor 1.124 nats/token" must not move.
_FLOORS = [((128, 4, 0, 32), 1.12380420083844), ((32, 3, 1, 16), 0.875004186432722),
           ((64, 4, 7, 40), 1.1234781689766415)]


@pytest.mark.parametrize(("args", "floor"), _FLOORS, ids=[str(a) for a, _ in _FLOORS])
def test_markov_chain_and_floor_equal_the_prototype_corpus(args, floor):
    vocab, branching, seed, seq_len = args
    corpus = MarkovCorpus(vocab, branching=branching, seed=seed)
    assert corpus.loss_floor(seq_len) == floor
    np.testing.assert_allclose(corpus.transition.sum(axis=1), 1.0, rtol=1e-12)


def test_markov_validation():
    with pytest.raises(ValueError, match="branching=0"):
        MarkovCorpus(8, branching=0)
    with pytest.raises(ValueError, match="seed=-1 must be >= 0"):
        MarkovCorpus(8, seed=-1)
    corpus = MarkovCorpus(8)
    with pytest.raises(TypeError, match="split='train' must be a Split member"):
        corpus.batch("train", np.arange(2), 4)
    with pytest.raises(ValueError, match="1-D integer array"):
        corpus.batch(Split.TRAIN, np.zeros((2, 2), np.int64), 4)
    with pytest.raises(ValueError, match="1-D integer array"):
        corpus.batch(Split.TRAIN, np.array([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match="sample ids must be >= 0"):
        corpus.batch(Split.TRAIN, np.array([0, -3]), 4)
    with pytest.raises(ValueError, match="seq_len=0 must be >= 1"):
        corpus.batch(Split.TRAIN, np.arange(2), 0)


# --- Byte corpus ------------------------------------------------------------------------------


def _tree(tmp_path):
    """A small tree: nested dirs, a binary file, a hidden dir; returns the expected stream."""
    (tmp_path / "b" / "c").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    files = {
        "a.txt": "alpha\n" * 40,
        "b/c/d.py": "print('deep')\n" * 30,
        "b/z.md": "# zeta é\n" * 50,  # non-ASCII UTF-8 is text
        "c.txt": "gamma\n" * 60,
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text, encoding="utf-8")
    (tmp_path / "b" / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x80]) * 64)
    (tmp_path / ".git" / "config").write_text("hidden\n")
    order = ["a.txt", "b/c/d.py", "b/z.md", "c.txt"]  # by relative path, component by component
    return b"".join(files[rel].encode() for rel in order)


def test_byte_corpus_reads_a_tree_in_path_order_and_skips_binary_files(tmp_path):
    expected = _tree(tmp_path)
    corpus = ByteCorpus.from_path(tmp_path, seed=1)
    assert (corpus.files, corpus.skipped_binary, corpus.vocab_size) == (4, 1, 256)
    assert corpus.loss_floor(8) is None
    # every byte lands in exactly one split, in stream order (blocks of 4096: all train here)
    assert corpus.split_size(Split.TRAIN) + corpus.split_size(Split.HELDOUT) == len(expected)
    one_split = ByteCorpus(TextFiles(expected, 4, 1), name="ref", rule=SplitRule(len(expected)))
    assert one_split.split_size(Split.TRAIN) == len(expected)
    description = corpus.describe()
    assert "4 files (1 binary skipped)" in description and "vocab 256" in description
    # a sample is a window of the stream, targets shifted by one
    tokens, targets = corpus.batch(Split.TRAIN, np.arange(50), 20)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    for row_tokens, row_targets in zip(tokens, targets, strict=True):
        window = bytes(row_tokens.astype(np.uint8)) + bytes([row_targets[-1]])
        assert window in expected


def test_content_digest_follows_the_bytes_not_the_path(tmp_path):
    """What a checkpoint records of its data: same content anywhere -> same digest; one byte
    changed, another split rule, another Markov chain -> another digest."""
    _tree(tmp_path / "one")
    _tree(tmp_path / "two")
    one, two = ByteCorpus.from_path(tmp_path / "one"), ByteCorpus.from_path(tmp_path / "two")
    assert one.content_digest() == two.content_digest()
    assert one.content_digest().startswith("sha256:") and len(one.content_digest()) == 71
    with open(tmp_path / "two" / "a.txt", "r+b") as f:
        f.write(bytes([f.read(1)[0] ^ 1]))  # one bit, size unchanged
    assert ByteCorpus.from_path(tmp_path / "two").content_digest() != one.content_digest()
    text = TextFiles(b"x" * 100, files=1, skipped_binary=0)
    assert (ByteCorpus(text, name="a").content_digest()
            != ByteCorpus(text, name="a", rule=SplitRule(block_bytes=64)).content_digest())
    digests = {MarkovCorpus(64, seed=s, branching=b).content_digest()
               for s, b in ((0, 4), (1, 4), (0, 3))}
    assert len(digests) == 3
    assert MarkovCorpus(64, seed=1).content_digest() == MarkovCorpus(64, seed=1).content_digest()


def test_byte_corpus_windows_are_deterministic_and_spread():
    text = TextFiles(" ".join(map(str, range(3000))).encode(), files=1, skipped_binary=0)
    a = ByteCorpus(text, name="numbers", seed=2).batch(Split.TRAIN, np.arange(64), 16)
    b = ByteCorpus(text, name="numbers", seed=2).batch(Split.TRAIN, np.arange(64), 16)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = ByteCorpus(text, name="numbers", seed=3).batch(Split.TRAIN, np.arange(64), 16)
    assert not np.array_equal(a.tokens, c.tokens)
    # starts are spread over the split: (almost) every window of 64 is distinct
    assert len({bytes(row.astype(np.uint8)) for row in a.tokens}) >= 62


def test_split_rule_sends_every_20th_block_to_heldout_and_the_splits_are_disjoint():
    rule = SplitRule(block_bytes=8, heldout_every=20)
    n_blocks = 45  # blocks 19 and 39 held out; the last block (44) is short
    stream = np.arange(n_blocks * 8 - 3, dtype=np.int64)  # unique values to trace every byte
    parts = rule.split(stream)
    held_blocks = np.unique(parts[Split.HELDOUT] // 8)
    np.testing.assert_array_equal(held_blocks, [19, 39])
    train_blocks = np.unique(parts[Split.TRAIN] // 8)
    assert set(train_blocks.tolist()).isdisjoint(held_blocks.tolist())
    np.testing.assert_array_equal(np.sort(np.concatenate(list(parts.values()))), stream)
    # each split keeps stream order
    for part in parts.values():
        assert np.all(np.diff(part) > 0)
    # a short last block that is a held-out block (index 19) goes to held-out
    np.testing.assert_array_equal(
        rule.split(np.arange(19 * 8 + 5))[Split.HELDOUT], 152 + np.arange(5)
    )


def test_byte_corpus_heldout_windows_come_from_heldout_blocks():
    stream = (np.arange(40 * 16) // 16 % 251).astype(np.uint8)  # byte value = block index
    corpus = ByteCorpus(TextFiles(stream.tobytes(), 1, 0), name="blocks", rule=SplitRule(16, 20))
    assert corpus.split_size(Split.HELDOUT) == 2 * 16
    tokens, _ = corpus.batch(Split.HELDOUT, heldout_ids(100), 8)
    assert set(np.unique(tokens).tolist()) <= {19, 39}
    tokens, _ = corpus.batch(Split.TRAIN, np.arange(500), 8)
    assert not {19, 39} & set(np.unique(tokens).tolist())


@pytest.fixture(scope="module")
def stdlib_corpus():
    return ByteCorpus.from_stdlib(seed=0)


def test_stdlib_corpus_is_megabytes_of_python(stdlib_corpus):
    corpus = stdlib_corpus
    assert corpus.split_size(Split.TRAIN) > 1_000_000
    assert corpus.split_size(Split.HELDOUT) > 50_000
    # about 1 byte in 20 is held out (every 20th 4096-byte block)
    total = corpus.split_size(Split.TRAIN) + corpus.split_size(Split.HELDOUT)
    assert abs(corpus.split_size(Split.HELDOUT) / total - 1 / 20) < 0.001
    tokens, targets = corpus.batch(Split.HELDOUT, heldout_ids(8), 256)
    assert tokens.shape == (8, 256) and tokens.max() < 256 and tokens.min() >= 0
    text = b"".join(bytes(row.astype(np.uint8)) for row in tokens)
    assert b"def " in text or b"import " in text or b"self" in text
    assert corpus.describe().startswith("stdlib: ")


def test_byte_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt' does not exist"):
        ByteCorpus.from_path(tmp_path / "nowhere.txt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blob").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"no UTF-8 text files found .*1 binary files skipped"):
        ByteCorpus.from_path(tmp_path / "empty")
    (tmp_path / "short.txt").write_text("0123456789")
    corpus = ByteCorpus.from_path(tmp_path / "short.txt")  # 10 bytes, all train
    corpus.batch(Split.TRAIN, np.arange(3), 9)  # exactly seq_len + 1 bytes: fine
    with pytest.raises(ValueError, match=r"train split holds 10 bytes.*needs seq_len \+ 1 = 11"):
        corpus.batch(Split.TRAIN, np.arange(3), 10)
    with pytest.raises(ValueError, match="heldout split holds 0 bytes"):
        corpus.batch(Split.HELDOUT, heldout_ids(1), 4)


def test_make_corpus(tmp_path):
    markov = make_corpus("markov", vocab_size=64, seed=3)
    assert isinstance(markov, MarkovCorpus) and markov.vocab_size == 64 and markov.seed == 3
    (tmp_path / "t.txt").write_text("hello world\n" * 10)
    byte = make_corpus(str(tmp_path / "t.txt"), vocab_size=256, seed=1)
    assert isinstance(byte, ByteCorpus) and byte.seed == 1
    with pytest.raises(FileNotFoundError, match=r"'no-such' is neither .*'markov', 'stdlib'"):
        make_corpus("no-such", vocab_size=256, seed=0)
    with pytest.raises(ValueError, match="vocab_size=128; pick a config with vocab_size >= 256"):
        make_corpus(str(tmp_path / "t.txt"), vocab_size=128, seed=0)


# --- Sample ids and data position -------------------------------------------------------------


def _step_ids(position, world_size, micro_batches, batch_size):
    """{(rank, micro_batch): ids} of one step."""
    return {
        (r, m): sample_ids(
            position,
            rank=r,
            world_size=world_size,
            micro_batch=m,
            micro_batches=micro_batches,
            batch_size=batch_size,
        )
        for r in range(world_size)
        for m in range(micro_batches)
    }


@given(
    start=st.integers(0, 10**12),
    world_size=st.integers(1, 8),
    micro_batches=st.integers(1, 4),
    batch_size=st.integers(1, 16),
)
def test_a_step_reads_one_contiguous_range_without_overlap(
    start, world_size, micro_batches, batch_size
):
    position = DataPosition(start)
    ids = _step_ids(position, world_size, micro_batches, batch_size)
    assert all(v.dtype == np.int64 and v.shape == (batch_size,) for v in ids.values())
    every = np.sort(np.concatenate(list(ids.values())))
    global_batch = world_size * micro_batches * batch_size
    np.testing.assert_array_equal(every, start + np.arange(global_batch))
    after = advance(
        position, world_size=world_size, micro_batches=micro_batches, batch_size=batch_size
    )
    assert after == DataPosition(start + global_batch)


def test_positions_and_step_data_do_not_depend_on_world_size():
    # global batch 48 as 1x6x8, 2x3x8, 4x3x4, 6x1x8
    layouts = [(1, 6, 8), (2, 3, 8), (4, 3, 4), (6, 1, 8)]
    corpus = MarkovCorpus(16, seed=0)
    trajectories = []
    for world_size, micro_batches, batch_size in layouts:
        position, seen = DataPosition(), []
        for _ in range(3):
            ids = np.concatenate(
                list(_step_ids(position, world_size, micro_batches, batch_size).values())
            )
            seen.append(np.sort(ids))
            position = advance(
                position, world_size=world_size, micro_batches=micro_batches, batch_size=batch_size
            )
        trajectories.append((position, seen))
    for position, seen in trajectories[1:]:
        assert position == trajectories[0][0] == DataPosition(144)
        for a, b in zip(seen, trajectories[0][1], strict=True):
            np.testing.assert_array_equal(a, b)
    # the same ids are the same samples, however they were assigned to ranks
    ids = trajectories[0][1][1]
    np.testing.assert_array_equal(
        corpus.batch(Split.TRAIN, ids, 8).tokens,
        np.concatenate([corpus.batch(Split.TRAIN, part, 8).tokens for part in np.split(ids, 6)]),
    )


def test_sample_ids_validation():
    pos = DataPosition(0)
    kwargs = dict(rank=0, world_size=2, micro_batch=0, micro_batches=2, batch_size=4)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        sample_ids(pos, **{**kwargs, "rank": 2})
    with pytest.raises(ValueError, match=r"micro_batch=-1 must be in \[0, micro_batches=2\)"):
        sample_ids(pos, **{**kwargs, "micro_batch": -1})
    for name in ("world_size", "micro_batches", "batch_size"):
        with pytest.raises(ValueError, match=f"{name}=0 must be >= 1"):
            sample_ids(pos, **{**kwargs, name: 0})
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        advance(pos, world_size=1, micro_batches=1, batch_size=0)
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        heldout_ids(0)
    np.testing.assert_array_equal(heldout_ids(3), [0, 1, 2])


def test_data_position_round_trip_and_bad_values():
    pos = DataPosition(12_345)
    state = pos.to_dict()
    assert state == {"samples_consumed": 12_345} and type(state["samples_consumed"]) is int
    assert DataPosition.from_dict(state) == pos
    with pytest.raises(ValueError, match="samples_consumed=-1 must be >= 0"):
        DataPosition.from_dict({"samples_consumed": -1})
    for bad in (1.0, True, "3", np.int64(3)):
        with pytest.raises(TypeError, match="must be a plain int"):
            DataPosition.from_dict({"samples_consumed": bad})
    with pytest.raises(ValueError, match=r"keys \[\] != expected \['samples_consumed'\]"):
        DataPosition.from_dict({})
    with pytest.raises(ValueError, match="keys .*'step'.* != expected"):
        DataPosition.from_dict({"samples_consumed": 0, "step": 3})
    with pytest.raises(TypeError, match="expected a mapping"):
        DataPosition.from_dict([("samples_consumed", 0)])


def test_split_sizes_count_what_split_gives_and_min_stream_bytes_is_the_smallest_fit():
    rule = SplitRule(block_bytes=8, heldout_every=4)
    for n in range(0, 100):
        parts = rule.split(np.zeros(n, np.uint8))
        assert rule.split_sizes(n) == {s: parts[s].size for s in Split}, n
    for window in (1, 5, 8, 9, 17):
        n = rule.min_stream_bytes(window)
        assert min(rule.split_sizes(n).values()) >= window
        assert min(rule.split_sizes(n - 1).values()) < window
    assert SplitRule().min_stream_bytes(33) == 19 * 4096 + 33  # the first held-out block


def test_a_text_too_small_for_the_held_out_split_is_refused_up_front(tmp_path):
    """A text under ~78 kB has no held-out block: it trained, then failed at the evaluation."""
    small = tmp_path / "small.txt"
    small.write_text("x" * 50_000)
    corpus = ByteCorpus.from_path(small)
    with pytest.raises(ValueError) as err:
        corpus.check_fits(32)
    text = str(err.value)
    assert "is too small for seq_len=32: its 50,000 bytes split into train 50,000, heldout 0" \
        in text, text
    assert "a sample needs seq_len + 1 = 33 bytes of each split (heldout short)" in text, text
    assert "give a text of at least 77,857 bytes" in text, text
    for size, fits in ((77_857, True), (77_856, False)):
        small.write_text("x" * size)
        corpus = ByteCorpus.from_path(small)
        if fits:
            corpus.check_fits(32)
            corpus.batch(Split.HELDOUT, heldout_ids(2), 32)  # what the evaluation reads
        else:
            with pytest.raises(ValueError, match="heldout short"):
                corpus.check_fits(32)
    make_corpus("markov", vocab_size=8, seed=0).check_fits(10_000)  # unbounded: always fits
