"""``mxfp8-export CHECKPOINT OUT``: a training checkpoint as Hugging Face GPT-2 safetensors.

Writes into the new directory ``OUT``:

- ``model.safetensors``: the checkpoint's fp32 **main weights** (``--dtype bf16``: rounded to
  nearest even) under Hugging Face ``GPT2LMHeadModel`` names: ``transformer.wte.weight``,
  ``transformer.wpe.weight``, ``transformer.h.<i>.{ln_1,ln_2}.{weight,bias}``,
  ``transformer.h.<i>.attn.c_attn.{weight,bias}``, ``...attn.c_proj``, ``...mlp.c_fc``,
  ``...mlp.c_proj``, ``transformer.ln_f.{weight,bias}``, ``lm_head.weight``. GPT-2's ``Conv1D``
  layers hold (in, out) matrices, so every linear weight is written transposed; this model's
  linears have no bias, so their biases are written as zeros.
- ``config.json``: a ``GPT2Config`` (``n_inner`` = d_ff, ``activation_function`` ``gelu_new``:
  the tanh GELU the model uses, ``tie_word_embeddings`` false: the LM head is its own matrix,
  dropouts 0) and, under ``mxfp8_fsdp``, where it came from (checkpoint, run id, step, the job).
- with ``--planes`` (MXFP8 runs): ``mxfp8_planes.safetensors``, every linear weight's MXFP8
  planes under this project's names (``h_0.attn.qkv.weight.rowwise_data`` ...): e4m3 data
  (``F8_E4M3``, (N, K) not transposed) and E8M0 scale bytes (``U8``: rowwise (N, K/32),
  colwise (N/32, K)), DESIGN.md 4. They are the planes the run computed with: MXFP8 quantization
  of ``bf16(main weight)`` (the exact ``xla`` reference, byte-identical to every backend and to
  the planes FSDP gathers), never requantized from dequantized values.

Loadable by ``transformers.GPT2LMHeadModel.from_pretrained(OUT)`` (its logits equal the Flax
twin's fp32 logits within 1e-4 of their largest magnitude, ``tests/apps/test_export.py``) and by
the Flax twin: ``load_export(OUT)`` gives the ``GPTConfig`` and the twin's parameters
(``models.flax_gpt.nested_params``), bit-identical to the checkpoint's main weights for an fp32
export.

Refused with an ``ExportError`` naming the problem: a path that is not a checkpoint, a checkpoint
whose files do not verify (sha256, sizes, run id: ``ShardedReader``), a parameter whose saved
pieces do not cover it exactly (an incomplete checkpoint: the missing or doubled element range is
named), parameters that are not this GPT's, ``--planes`` for a run without MXFP8 linears, and an
``OUT`` that exists and is not empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.model_config import PRESETS, GPTConfig

__all__ = ["ExportError", "export", "hf_names", "load_export", "main", "read_main_weights"]

WEIGHTS_FILE = "model.safetensors"
PLANES_FILE = "mxfp8_planes.safetensors"
CONFIG_FILE = "config.json"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8",
              torch.float8_e4m3fn: "F8_E4M3"}
_ST_BACK = {v: k for k, v in _ST_DTYPES.items()}


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output that cannot be written."""


# ------------------------------------------------------------------ reading the checkpoint


def _pieces(entries: Iterable[str], name: str) -> list[tuple[int, str]]:
    prefix = f"main/{name}/"
    return sorted((int(k[len(prefix):]), k) for k in entries
                  if k.startswith(prefix) and k[len(prefix):].isdigit())


def assemble(name: str, shape: Sequence[int], pieces: Sequence[tuple[int, int]],
             read: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The full fp32 parameter ``name`` from its saved pieces ``(offset, numel)`` (sorted), each
    read by ``read(index)``; an ``ExportError`` naming the element range that is missing or
    saved twice unless they cover ``[0, numel)`` exactly."""
    numel = int(np.prod(shape)) if shape else 1
    at = 0
    for offset, n in pieces:
        if offset != at:
            what = "missing" if offset > at else "saved twice"
            lo, hi = (at, offset) if offset > at else (offset, at)
            raise ExportError(f"incomplete checkpoint: parameter {name!r} has elements "
                              f"[{lo}, {hi}) {what} (pieces at offsets {[o for o, _ in pieces]})")
        at += n
    if at != numel:
        raise ExportError(f"incomplete checkpoint: parameter {name!r} has elements [{at}, "
                          f"{numel}) missing (its pieces end at element {at})")
    parts = [read(i).reshape(-1) for i in range(len(pieces))]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)
    return flat.reshape(tuple(shape))


def _read_piece(reader: Any, keys: Sequence[str], i: int) -> torch.Tensor:
    return reader.read(keys[i])


def read_main_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(verified meta.json, {parameter name: full fp32 main weight}) of a training checkpoint:
    a step directory, or a save directory (its ``latest``)."""
    from apps.training.checkpoint import SCHEMA, resolve
    from torch_side.checkpoint.sharded_files import CheckpointError, ShardedReader

    try:
        where = resolve(path)
        with ShardedReader(where, SCHEMA) as reader:
            meta = reader.meta
            params = meta.get("params")
            if not isinstance(params, dict) or not isinstance(meta.get("job"), dict):
                raise ExportError(f"{where}: meta.json has no 'params' or 'job': not a "
                                  f"training checkpoint of mxfp8-train")
            weights = {}
            for name, shape in params.items():
                keys = _pieces(reader.entries, name)
                sizes = [(off, reader.entries[k].numel) for off, k in keys]
                weights[name] = assemble(name, shape, sizes, functools.partial(
                    _read_piece, reader, [k for _, k in keys]))
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    return {**meta, "checkpoint": str(where)}, weights


# ------------------------------------------------------------------ the GPT-2 names


def config_of(meta: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> GPTConfig:
    """The checkpoint's ``GPTConfig``: its job's preset with the vocabulary it trained with,
    checked against every saved parameter's name and shape."""
    preset = meta["job"].get("config")
    if preset not in PRESETS:
        raise ExportError(f"the checkpoint's job names config {preset!r}, not one of "
                          f"{sorted(PRESETS)}")
    if "wte.weight" not in weights:
        raise ExportError("the checkpoint has no 'wte.weight': not this project's GPT")
    cfg = dataclasses.replace(PRESETS[preset], vocab_size=int(weights["wte.weight"].shape[0]))
    want = expected_shapes(cfg)
    if set(want) != set(weights) or any(tuple(weights[k].shape) != v for k, v in want.items()):
        extra, missing = sorted(set(weights) - set(want)), sorted(set(want) - set(weights))
        wrong = sorted(k for k in set(want) & set(weights)
                       if tuple(weights[k].shape) != want[k])
        raise ExportError(f"the checkpoint's parameters are not the GPT of config {preset!r} "
                          f"(vocabulary {cfg.vocab_size}): unexpected {extra[:4]}, missing "
                          f"{missing[:4]}, other shapes {wrong[:4]}")
    return cfg


def expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    d, f = cfg.d_model, cfg.d_ff
    out: dict[str, tuple[int, ...]] = {"wte.weight": (cfg.vocab_size, d),
                                       "wpe.weight": (cfg.max_seq_len, d)}
    for i in range(cfg.n_layer):
        for ln in ("ln_1", "ln_2"):
            out[f"h_{i}.{ln}.weight"] = out[f"h_{i}.{ln}.bias"] = (d,)
        out[f"h_{i}.attn.qkv.weight"] = (3 * d, d)
        out[f"h_{i}.attn.proj.weight"] = (d, d)
        out[f"h_{i}.mlp.fc.weight"] = (f, d)
        out[f"h_{i}.mlp.proj.weight"] = (d, f)
    out["ln_f.weight"] = out["ln_f.bias"] = (d,)
    out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


_LINEARS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
            "mlp.proj": "mlp.c_proj"}


def hf_names(cfg: GPTConfig) -> dict[str, tuple[str, bool]]:
    """{this model's name: (GPT-2 name, transposed)} for every parameter; the GPT-2 biases of
    the linears (zeros) are not in it."""
    out = {"wte.weight": ("transformer.wte.weight", False),
           "wpe.weight": ("transformer.wpe.weight", False),
           "ln_f.weight": ("transformer.ln_f.weight", False),
           "ln_f.bias": ("transformer.ln_f.bias", False),
           "lm_head.weight": ("lm_head.weight", False)}
    for i in range(cfg.n_layer):
        for ln in ("ln_1", "ln_2"):
            for leaf in ("weight", "bias"):
                out[f"h_{i}.{ln}.{leaf}"] = (f"transformer.h.{i}.{ln}.{leaf}", False)
        for ours, theirs in _LINEARS.items():
            out[f"h_{i}.{ours}.weight"] = (f"transformer.h.{i}.{theirs}.weight", True)
    return out


def hf_config(cfg: GPTConfig, dtype: torch.dtype, source: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.ln_eps,
        "initializer_range": cfg.init_std, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "scale_attn_weights": True, "tie_word_embeddings": False,
        "use_cache": True, "torch_dtype": "float32" if dtype == torch.float32 else "bfloat16",
        "mxfp8_fsdp": dict(source),
    }


# ------------------------------------------------------------------ safetensors


def _write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                       specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                       metadata: Mapping[str, str]) -> None:
    """The safetensors format (an 8-byte little-endian header size, a JSON header of dtype,
    shape and data offsets, then the raw little-endian data), written tensor by tensor so that
    only one is in memory; ``specs`` declares them in the order ``tensors`` yields them."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    at = 0
    for name, dtype, shape in specs:
        n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, t), (want, dtype, shape) in zip(tensors, specs, strict=True):
            assert name == want and t.dtype == dtype and tuple(t.shape) == shape, name
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file written by ``export``."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    base = 8 + n
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        buf = bytearray(data[base + lo:base + hi])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(_ST_BACK[h["dtype"]]).reshape(h["shape"])
    return out, meta


# ------------------------------------------------------------------ export


def _as_gpt2(w: torch.Tensor, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    return (w.T if transposed else w).to(dtype)


def _hf_tensors(cfg: GPTConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
                ) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """(GPT-2 name, shape, maker) in file order, the zero biases of the linears included."""
    out: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]] = []
    for ours, (theirs, transposed) in hf_names(cfg).items():
        w = weights[ours]
        shape = tuple(w.shape[::-1]) if transposed else tuple(w.shape)
        out.append((theirs, shape, functools.partial(_as_gpt2, w, transposed, dtype)))
        if transposed:
            n = int(w.shape[0])
            out.append((theirs[:-len("weight")] + "bias", (n,),
                        functools.partial(torch.zeros, n, dtype=dtype)))
    return out


def _planes(weights: Mapping[str, torch.Tensor], names: Sequence[str]
            ) -> list[tuple[str, Callable[[], dict[str, torch.Tensor]]]]:
    def planes_of(w: torch.Tensor) -> dict[str, torch.Tensor]:
        import jax.numpy as jnp
        from jax import lax

        from common.kernels import KernelConfig
        from jax_side.linear import quantize_weight

        t = quantize_weight(jnp.asarray(w.numpy()), kernels=KernelConfig.reference())
        out = {}
        for plane, (data, scale) in t.planes.items():
            out[f"{plane.value}_data"] = torch.from_numpy(
                np.asarray(lax.bitcast_convert_type(data, jnp.uint8)).copy()).view(
                torch.float8_e4m3fn)
            out[f"{plane.value}_scale"] = torch.from_numpy(
                np.asarray(lax.bitcast_convert_type(scale, jnp.uint8)).copy())
        return out

    return [(name, functools.partial(planes_of, weights[name])) for name in names]


def export(checkpoint: str | Path, out: str | Path, *, dtype: torch.dtype = torch.float32,
           planes: bool = False) -> Path:
    """Write ``checkpoint`` into the new directory ``out`` (module note); returns ``out``."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ExportError(f"export: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; export into a new one")
    meta, weights = read_main_weights(checkpoint)
    cfg = config_of(meta, weights)
    job = meta["job"]
    linears = [n for n, (_, t) in hf_names(cfg).items() if t] + ["lm_head.weight"]
    if planes and job.get("weights") != "mxfp8":
        raise ExportError(f"--planes: the checkpoint's run trained with --weights "
                          f"{job.get('weights')!r}, so its linears have no MXFP8 planes; export "
                          f"without --planes")
    out.mkdir(parents=True, exist_ok=True)
    source = {"checkpoint": meta["checkpoint"], "run_id": meta.get("run_id"),
              "step": meta.get("step"), "job": job}
    makers = _hf_tensors(cfg, weights, dtype)
    _write_safetensors(out / WEIGHTS_FILE, ((n, make()) for n, _, make in makers),
                       [(n, dtype, shape) for n, shape, _ in makers],
                       {"format": "pt", "source": json.dumps(source)})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(cfg, dtype, source), indent=1) + "\n")
    if planes:
        found = [(name, make()) for name, make in _planes(weights, linears)]
        tensors = [(f"{name}.{k}", v) for name, ps in found for k, v in ps.items()]
        _write_safetensors(
            out / PLANES_FILE, tensors, [(n, t.dtype, tuple(t.shape)) for n, t in tensors],
            {"format": "mxfp8", "layout": "DESIGN.md 4: data (N, K) e4m3, not transposed; "
             "rowwise scales (N, K/32) and colwise (N/32, K) E8M0 bytes",
             "source": json.dumps(source)})
    return out


def load_export(path: str | Path) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """(GPTConfig, {this model's parameter name: float32 array}) of an ``export`` directory,
    for the Flax twin (``models.flax_gpt.nested_params``) or ``TorchGPT``."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    job = config.get("mxfp8_fsdp", {}).get("job", {})
    tensors, _ = read_safetensors(path / WEIGHTS_FILE)
    cfg = dataclasses.replace(PRESETS[job["config"]], vocab_size=config["vocab_size"])
    weights = {}
    for ours, (theirs, transposed) in hf_names(cfg).items():
        t = tensors[theirs].float()
        weights[ours] = (t.T if transposed else t).contiguous().numpy()
    return cfg, weights


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mxfp8-export", description="Export a training checkpoint as Hugging Face GPT-2 "
        "safetensors (model.safetensors + config.json) and, with --planes, its MXFP8 planes.")
    p.add_argument("checkpoint", help="a step directory, or a save directory (its latest)")
    p.add_argument("out", help="a new (or empty) directory to write")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the weights' dtype (bf16: rounded to nearest even from fp32)")
    p.add_argument("--planes", action="store_true",
                   help="also write mxfp8_planes.safetensors: every linear weight's MXFP8 "
                        "planes as the run computed them (MXFP8 runs only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    try:
        out = export(args.checkpoint, args.out, dtype=dtype, planes=args.planes)
    except ExportError as e:
        print(f"mxfp8-export: error: {e}", file=sys.stderr)
        return 2
    print(f"mxfp8-export: wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
