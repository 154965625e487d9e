"""The optimizer: AdamW over two parameter groups (weight decay on matrices only), and its learning-rate
schedule (:func:`lr_at`, which the trainer sets before every step)."""

from __future__ import annotations

import math

from .config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to optim.lr, then cosine decay to optim.min_lr at train.steps. ``step`` is 1-based."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))


def adamw_implementation(device) -> str:
    """Which AdamW kernel ``device`` gets: ``fused`` (one kernel for every parameter) on CUDA, ``foreach``
    (batched per-op kernels over the parameter list) elsewhere."""
    return "fused" if device.type == "cuda" else "foreach"


def build_optimizer(model, cfg: TrainConfig, device):
    """AdamW for ``model``: weight decay on the parameters of 2 dimensions or more, none on the others
    (biases, norms); fused on CUDA, foreach elsewhere; the LR of step 1."""
    import torch

    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr_at(cfg, 1),
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        **{adamw_implementation(device): True},
    )
