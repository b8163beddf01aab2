"""``mxfp8-export`` (apps/export.py): a training checkpoint as Hugging Face GPT-2 safetensors.

One checkpoint of the tiny GPT after one AdamW step (as tests/apps/training/test_checkpoint.py
makes it) is exported; the files are read back with the ``safetensors`` library, loaded by
``transformers``' GPT-2 (logits against the Flax twin's fp32 logits) and by the Flax twin (bit
for bit), the MXFP8 planes compared with the planes FSDP gathers, and bad inputs refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from apps import export as ex
from apps.training.checkpoint import CheckpointSaver
from apps.training.data import DataPosition
from apps.training.job import TrainJob, Weights
from apps.training.loop import _Model
from common.modes import Activations, LinearMode
from models.flax_gpt import FlaxGPT, nested_params

pytestmark = pytest.mark.usefixtures("single_rank_world")

JOB = TrainJob(steps=2, micro_batches=1, batch_size=2, seq_len=32, seed=7)
# transformers' GPT-2 against the Flax twin, both fp32: the same math in another order of
# operations (attention, GELU, LayerNorm); measured 4e-7 of the largest logit
HF_BOUND = 1e-4


def _trained(job: TrainJob) -> _Model:
    m = _Model(job)
    g = torch.Generator().manual_seed(3)
    for group in m.opt.groups:
        for p in group.main_pieces():
            group.main_grad[p.shard_offset:p.shard_offset + p.numel] = torch.randn(
                p.numel, generator=g)
    m.opt.step()
    m.opt.zero_grad()
    return m


def _save(m: _Model, job: TrainJob, save_dir: Path) -> Path:
    with CheckpointSaver.start(save_dir) as saver:
        return saver.save(step=1, fsdp=m.fsdp, opt=m.opt, position=DataPosition(4),
                          job=job.describe(), data_digest=m.corpus.content_digest())


@pytest.fixture(scope="module")
def saved(tmp_path_factory, single_rank_world):
    """(model, its checkpoint's save dir, an fp32 export with planes)."""
    root = tmp_path_factory.mktemp("export")
    m = _trained(JOB)
    _save(m, JOB, root / "ck")
    assert ex.main([str(root / "ck"), str(root / "out"), "--planes"]) == 0
    return m, root / "ck", root / "out"


def _flax_logits(cfg, flat: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    model = FlaxGPT(cfg, mode=LinearMode.HIGH_PRECISION, activations=Activations.FP32)
    params = nested_params({k: jnp.asarray(v) for k, v in flat.items()})
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))


def test_the_weights_are_the_main_weights_under_gpt2_names(saved):
    from safetensors.torch import load_file

    m, _, out = saved
    main = m.fsdp.full_state_dict()
    got = load_file(str(out / ex.WEIGHTS_FILE))
    cfg = m.cfg
    assert got["transformer.h.0.attn.c_attn.weight"].shape == (cfg.d_model, 3 * cfg.d_model)
    for ours, (theirs, transposed) in ex.hf_names(cfg).items():
        want = main[ours].T if transposed else main[ours]
        assert torch.equal(got[theirs], want), ours
    assert torch.count_nonzero(got["transformer.h.1.mlp.c_fc.bias"]) == 0
    assert len(got) == len(ex.hf_names(cfg)) + 4 * cfg.n_layer  # + the linears' zero biases
    config = json.loads((out / ex.CONFIG_FILE).read_text())
    assert (config["n_embd"], config["n_inner"], config["vocab_size"]) == (
        cfg.d_model, cfg.d_ff, cfg.vocab_size)
    assert config["mxfp8_fsdp"]["step"] == 1 and config["mxfp8_fsdp"]["job"]["seed"] == 7


def test_transformers_gpt2_loads_it_and_agrees_with_the_flax_twin(saved):
    transformers = pytest.importorskip("transformers")
    m, _, out = saved
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out), torch_dtype=torch.float32)
    hf.eval()
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    main = {k: v.numpy() for k, v in m.fsdp.full_state_dict().items()}
    ours = _flax_logits(m.cfg, main, tokens)
    err = np.abs(theirs - ours).max() / np.abs(ours).max()
    assert err < HF_BOUND, err


def test_the_flax_twin_loads_it_bit_for_bit(saved):
    m, _, out = saved
    cfg, flat = ex.load_export(out)
    assert cfg == m.cfg
    main = m.fsdp.full_state_dict()
    for name, v in flat.items():
        np.testing.assert_array_equal(v, main[name].numpy(), err_msg=name)
    tokens = np.arange(20).reshape(2, 10) % cfg.vocab_size
    np.testing.assert_array_equal(_flax_logits(cfg, flat, tokens),
                                  _flax_logits(cfg, {k: v.numpy() for k, v in main.items()},
                                               tokens))


def test_the_planes_are_the_ones_fsdp_gathers(saved):
    from safetensors.torch import load_file

    m, _, out = saved
    planes = load_file(str(out / ex.PLANES_FILE))
    with m.fsdp.gathered_weights() as gathered:
        checked = 0
        for name, t in gathered.items():
            if not hasattr(t, "planes"):
                continue
            for plane, (data, scale) in t.planes.items():
                got_d = planes[f"{name}.{plane.value}_data"]
                assert got_d.dtype == torch.float8_e4m3fn
                assert torch.equal(got_d.view(torch.uint8), data.reshape(got_d.shape).view(
                    torch.uint8)), name
                assert torch.equal(planes[f"{name}.{plane.value}_scale"],
                                   scale.reshape(-1).view(torch.uint8).reshape(
                                       planes[f"{name}.{plane.value}_scale"].shape)), name
                checked += 1
    assert checked == 2 * (4 * m.cfg.n_layer + 1)


def test_bf16_export_rounds_the_main_weights(saved, tmp_path):
    m, ck, _ = saved
    ex.export(ck, tmp_path / "bf16", dtype=torch.bfloat16)
    got, _ = ex.read_safetensors(tmp_path / "bf16" / ex.WEIGHTS_FILE)
    main = m.fsdp.full_state_dict()
    assert torch.equal(got["lm_head.weight"], main["lm_head.weight"].to(torch.bfloat16))
    assert json.loads((tmp_path / "bf16" / ex.CONFIG_FILE).read_text())["torch_dtype"] == (
        "bfloat16")


def test_refusals_name_the_problem(saved, tmp_path, capsys):
    _, ck, out = saved
    assert ex.main([str(ck), str(out)]) == 2  # not empty
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert ex.main([str(tmp_path), str(tmp_path / "o")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    with pytest.raises(ex.ExportError, match=r"'h_0.mlp.fc.weight' has elements \[8, 16\) "
                                             r"missing"):
        ex.assemble("h_0.mlp.fc.weight", (4, 8), [(0, 8), (16, 16)],
                    lambda i: torch.zeros(8 if i == 0 else 16))
    with pytest.raises(ex.ExportError, match=r"elements \[24, 32\) missing"):
        ex.assemble("w", (4, 8), [(0, 24)], lambda i: torch.zeros(24))
    with pytest.raises(ex.ExportError, match="saved twice"):
        ex.assemble("w", (4, 8), [(0, 16), (8, 24)], lambda i: torch.zeros(16 + 8 * i))


def test_planes_of_a_run_without_mxfp8_linears_are_refused(tmp_path):
    job = TrainJob(steps=1, micro_batches=1, batch_size=2, seq_len=32, seed=7,
                   weights=Weights.BF16)
    _save(_trained(job), job, tmp_path / "ck")
    with pytest.raises(ex.ExportError, match="--weights 'bf16'.*no MXFP8 planes"):
        ex.export(tmp_path / "ck", tmp_path / "out", planes=True)
    ex.export(tmp_path / "ck", tmp_path / "out2")  # the weights themselves export


def _save_at_world(ctx, root: Path, out: dict) -> None:
    m = _trained(JOB)
    _save(m, JOB, root / "ck2")
    full = m.fsdp.full_state_dict()
    if ctx.rank == 0:
        out.update(full)


def test_a_checkpoint_saved_by_two_ranks_exports_whole(tmp_path):
    from tests.torch_side.threaded_world import run_world

    full: dict[str, torch.Tensor] = {}
    run_world(2, _save_at_world, tmp_path, full)
    meta, _ = ex.read_main_weights(tmp_path / "ck2")
    assert meta["world_size"] == 2
    ex.export(tmp_path / "ck2", tmp_path / "out")
    got, _ = ex.read_safetensors(tmp_path / "out" / ex.WEIGHTS_FILE)
    cfg, flat = ex.load_export(tmp_path / "out")
    assert set(flat) == set(full)
    for name, value in full.items():  # every parameter assembled from both ranks' pieces
        assert torch.equal(torch.from_numpy(flat[name]), value), name
    assert torch.equal(got["lm_head.weight"], full["lm_head.weight"])
