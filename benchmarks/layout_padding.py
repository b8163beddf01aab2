"""Padding overhead of FSDP's flat layout (``torch_side.fsdp.flat_layout``), GPT- and conv-style
models.

The layout starts every parameter at a multiple of ``U = lcm(256, row sizes of the group)`` and
makes each rank's shard a multiple of U (so shards keep rows whole). Row sizes that share few
factors with 256 and with each other -- conv kernels ``in * kh * kw`` such as 147 or 576 -- make
U large and the buffers mostly padding. This script builds the layouts FSDP would build (one
group per (unit, format); units as the apps use them) from parameter shapes alone and prints,
per model and world size, the padding ratio (buffer elements / parameter elements) of the whole
model and of its worst group, as a markdown table (docs/fsdp.md, "Flat layout and buffers").

    python -m benchmarks.layout_padding

A second table compares the two shard layouts of MXFP8 groups (``ShardLayout``, issue 34):
``lcm`` (rows whole) and ``block_atomic`` (whole 32-row scale blocks: unit
``lcm(256, 32 x row sizes)``) on GPT-2 124M / 350M and GPT 1.3B at world sizes 2-64, one unit per
block: the padding ratio of the MXFP8 groups (the fp32 groups are the same in both).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from common.model_config import GPT2_124M, GPT2_350M, GPT_1_3B, TINY, GPTConfig
from torch_side.fsdp.flat_layout import FlatLayout

Shape = tuple[int, ...]
# unit name -> group name -> [(parameter name, shape)]
Model = dict[str, dict[str, list[tuple[str, Shape]]]]

WORLD_SIZES = (1, 2, 4, 8)


def gpt(cfg: GPTConfig) -> Model:
    """TorchGPT's groups with one unit per block: MXFP8 linear weights and fp32 LayerNorms per
    block; the root holds the embeddings, ln_f (fp32) and lm_head (MXFP8)."""
    d = cfg.d_model
    lin = cfg.linear_shapes()
    model: Model = {
        "<root>": {
            "mxfp8": [("lm_head.weight", lin["lm_head.weight"])],
            "fp32": [("wte.weight", (cfg.vocab_size, d)), ("wpe.weight", (cfg.max_seq_len, d)),
                     ("ln_f.weight", (d,)), ("ln_f.bias", (d,))],
        }
    }
    for i in range(cfg.n_layer):
        p = f"h_{i}"
        model[p] = {
            "mxfp8": [(n, s) for n, s in lin.items() if n.startswith(p + ".")],
            "fp32": [
                (f"{p}.{ln}.{w}", (d,)) for ln in ("ln_1", "ln_2") for w in ("weight", "bias")
            ],
        }
    return model


def _conv_bn(name: str, cin: int, cout: int, k: int) -> list[tuple[str, Shape]]:
    return [(f"{name}.weight", (cout, cin, k, k)), (f"{name}_bn.weight", (cout,)),
            (f"{name}_bn.bias", (cout,))]


def resnet18(one_unit: bool = False) -> Model:
    """ResNet-18 (conv weights (out, in, kh, kw), BatchNorm affine, fc (1000, 512)), all fp32:
    one unit per BasicBlock, or the whole model as one unit."""
    root = _conv_bn("conv1", 3, 64, 7) + [("fc.weight", (1000, 512)), ("fc.bias", (1000,))]
    units: dict[str, list[tuple[str, Shape]]] = {}
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            name = f"layer{stage}.{b}"
            params = _conv_bn(f"{name}.conv1", cin, cout, 3) + _conv_bn(f"{name}.conv2", cout,
                                                                          cout, 3)
            if cin != cout:
                params += _conv_bn(f"{name}.downsample", cin, cout, 1)
            units[name] = params
            cin = cout
    if one_unit:
        return {"<root>": {"fp32": root + [p for ps in units.values() for p in ps]}}
    return {"<root>": {"fp32": root}, **{u: {"fp32": ps} for u, ps in units.items()}}


def small_cnn(one_unit: bool = True) -> Model:
    """A CIFAR-style CNN: convs 3->32->64->128 (3x3) and a (10, 2048) classifier, in one unit or
    one unit per conv (+ BatchNorm)."""
    convs = {c: _conv_bn(c, cin, cout, 3) for c, cin, cout in
             (("c1", 3, 32), ("c2", 32, 64), ("c3", 64, 128))}
    head = [("fc.weight", (10, 2048)), ("fc.bias", (10,))]
    if one_unit:
        return {"<root>": {"fp32": [p for ps in convs.values() for p in ps] + head}}
    return {"<root>": {"fp32": head}, **{c: {"fp32": ps} for c, ps in convs.items()}}


def layouts(model: Model, world_size: int, mxfp8_row_block: int = 1
            ) -> Iterator[tuple[str, FlatLayout]]:
    """Each group's layout; ``mxfp8_row_block`` 32: block-atomic shards for the MXFP8 groups."""
    for unit, groups in model.items():
        for group, params in groups.items():
            names, shapes = zip(*params, strict=True)
            rows = mxfp8_row_block if group == "mxfp8" else 1
            yield f"{unit}/{group}", FlatLayout.build(names, shapes, world_size, rows)


def mxfp8_padding(model: Model, world_size: int, row_block: int) -> float:
    """Buffer elements / parameter elements of the MXFP8 groups only."""
    real = padded = 0
    for label, layout in layouts(model, world_size, row_block):
        if label.endswith("/mxfp8"):
            real += layout.real_numel
            padded += layout.padded_numel
    return padded / real


def padding(model: Model, world_size: int) -> tuple[float, str, float, int]:
    """(whole-model ratio, worst group, its ratio, its unit U)."""
    real = padded = 0
    worst = ("", 0.0, 0)
    for label, layout in layouts(model, world_size):
        real += layout.real_numel
        padded += layout.padded_numel
        if layout.padding_ratio > worst[1]:
            worst = (label, layout.padding_ratio, layout.unit)
    return padded / real, *worst


MODELS = {
    "GPT tiny (d 64, 2 blocks)": gpt(TINY),
    "GPT-2 124M (d 768, 12 blocks)": gpt(GPT2_124M),
    "ResNet-18, unit per block": resnet18(),
    "ResNet-18, one unit": resnet18(one_unit=True),
    "CIFAR CNN, one unit": small_cnn(),
    "CIFAR CNN, unit per conv": small_cnn(one_unit=False),
}


LAYOUT_MODELS = {
    "GPT-2 124M": gpt(GPT2_124M),
    "GPT-2 350M": gpt(GPT2_350M),
    "GPT 1.3B": gpt(GPT_1_3B),
}
LAYOUT_WORLD_SIZES = (2, 4, 8, 16, 32, 64)


def layout_table() -> str:
    """MXFP8 groups' padding, lcm / block_atomic, per model and world size (markdown)."""
    lines = ["| model (MXFP8 groups) | " + " | ".join(f"W={w}" for w in LAYOUT_WORLD_SIZES)
             + " |", "|---|" + "---|" * len(LAYOUT_WORLD_SIZES)]
    for name, model in LAYOUT_MODELS.items():
        cells = [f"{mxfp8_padding(model, w, 1):.3f} / {mxfp8_padding(model, w, 32):.3f}"
                 for w in LAYOUT_WORLD_SIZES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    print("| model | params | " + " | ".join(f"W={w}" for w in WORLD_SIZES) + " | worst group "
          "(W=2): ratio, unit U |")
    print("|---|---|" + "---|" * len(WORLD_SIZES) + "---|")
    for name, model in MODELS.items():
        n = sum(math.prod(s) for g in model.values() for ps in g.values() for _, s in ps)
        cells = [f"{padding(model, w)[0]:.2f}x" for w in WORLD_SIZES]
        _, label, ratio, unit = padding(model, 2)
        print(f"| {name} | {n / 1e6:.2f} M | " + " | ".join(cells)
              + f" | `{label}`: {ratio:.1f}x, U = {unit} |")
    print("\nMXFP8 groups, padding ratio lcm / block_atomic (one unit per block):\n")
    print(layout_table())


if __name__ == "__main__":
    main()
