"""A run's exported final model (``model.safetensors``): its loss on the held-out shard, and how it
compares with another region's."""

from __future__ import annotations

from pathlib import Path


def same_params(x: Path, y: Path) -> bool:
    """Whether the two exported models hold the same tensors, bitwise."""
    import torch
    from safetensors.torch import load_file

    px, py = load_file(str(x)), load_file(str(y))
    return px.keys() == py.keys() and all(torch.equal(px[k], py[k]) for k in px)


def distance(x: Path, y: Path) -> tuple[bool, float]:
    """Whether the two exported models hold the same tensors bitwise, and the largest difference."""
    import torch
    from safetensors.torch import load_file

    px, py = load_file(str(x)), load_file(str(y))
    if px.keys() != py.keys():
        raise RuntimeError(f"{x} and {y} hold different tensors")
    same = all(torch.equal(px[k], py[k]) for k in px)
    return same, max(float((px[k].float() - py[k].float()).abs().max()) for k in px)


def heldout_loss(model_file: Path, model_cfg: dict, shard: Path, n_windows: int, batch: int = 64) -> float:
    """Mean next-byte cross-entropy of the exported model over ``n_windows`` fixed windows spread evenly
    over ``shard`` (fp32, CPU, eval mode)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from sbatch_gen.train.config import ModelConfig
    from sbatch_gen.train.model import GPT

    mc = ModelConfig(**model_cfg)
    model = GPT(mc)
    model.load_state_dict(load_file(str(model_file)))
    model.eval()
    tokens = np.fromfile(shard, dtype=np.uint8)
    seq = mc.seq_len
    total = (tokens.size - 1) // seq
    if total < n_windows:
        raise ValueError(f"{shard}: {total} windows of {seq}, fewer than {n_windows}")
    offs = np.linspace(0, total - 1, n_windows).astype(np.int64) * seq
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(0, n_windows, batch):
            win = torch.from_numpy(
                np.stack([tokens[o : o + seq + 1] for o in offs[i : i + batch]]).astype(np.int64)
            )
            loss_sum += float(model(win[:, :-1], win[:, 1:])) * win.shape[0]
    return loss_sum / n_windows
