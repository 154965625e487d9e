"""The trainer's checkpoint state: the model and optimizer state dicts, where the loop is (step, tokens,
the sampler), this rank's RNG streams, and the cross-region sync's outer state."""

from __future__ import annotations


def rng_key(info) -> str:
    """This rank's entry under ``rng``: every rank saves its own streams (dropout)."""
    return f"rank{info.rank}"


def rng_state(device) -> dict:
    """The CPU generator's state, and on CUDA the device's."""
    import torch

    s = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(rng: dict, device) -> None:
    """Restore the CPU generator, and the device's when ``rng`` has it and this process runs on CUDA."""
    import torch

    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def train_state(t) -> dict:
    """Trainer ``t``'s state as it is saved, and as the template a load fills in."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(t.model, t.optimizer)
    state = {
        "model": msd,
        "optim": osd,
        "train": {
            "step": t.step,
            "tokens_seen": t.tokens_seen,
            "sampler": t.batches.state_dict(),
            "data_sha256": t.shard.sha256,
        },
    }
    state["rng"] = {rng_key(t.info): rng_state(t.device)}
    if t.sync is not None:
        state["outer"] = t.sync.state_dict()
    return state
