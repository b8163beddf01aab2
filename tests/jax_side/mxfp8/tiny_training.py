"""Two training steps of a tiny GPT through FSDP's unit programs (one unit of two blocks, world 1:
the caller holds ``single_rank_world``), for tests that compare GEMM paths end to end."""

from __future__ import annotations

from common.kernels import KernelConfig


def two_step_losses(kernels: KernelConfig) -> list[float]:
    """The losses of two AdamW steps (lr 1e-2) on fixed tokens, model seed 1."""
    import torch

    from common.model_config import GPTConfig
    from models.torch_gpt import TorchGPT
    from torch_side import FSDPOptimizer, fully_shard

    cfg = GPTConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=2, d_model=128, d_ff=256)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    net = TorchGPT(cfg, seed=1, kernels=kernels)
    model = fully_shard(net, unit_modules=net.block_units(2), kernels=kernels)
    opt = FSDPOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=False)
    out = []
    for _ in range(2):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out
