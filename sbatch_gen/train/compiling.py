"""``train.compile``: torch.compile each transformer block, in place (``Module.compile``: parameter names and
checkpoints stay the eager model's), before DDP or FSDP2 wrap it, as torchtitan does. One graph serves
every block (they are the same code with the same shapes), so the first step compiles once.

Off, with one line saying why, where the backend cannot compile: dynamo unsupported on this Python, no C++
compiler for inductor on the CPU, no Triton on CUDA.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys

log = logging.getLogger("sbatch_gen.train")


def compile_blocker(device) -> str | None:
    """Why blocks cannot be compiled on ``device`` here (None: they can)."""
    import torch

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support Python {sys.version.split()[0]} in torch {torch.__version__}"
    if device.type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        if shutil.which(cxx) is None:
            return f"inductor needs a C++ compiler on the CPU and {cxx} is not on PATH (set CXX)"
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs Triton on CUDA and it does not import"
    else:
        return f"no inductor backend for {device.type}"
    return None


def compile_blocks(model, device, deterministic: bool, mode: str = "default") -> bool:
    """Compile every block of ``model`` in place with torch.compile's ``mode``; returns whether it did
    (else one warning said why). ``deterministic``: compiled random ops (dropout) draw as eager ones do, so
    a compiled run's losses match an eager run's and stay bitwise across a resume."""
    why = compile_blocker(device)
    if why is not None:
        log.warning("train.compile: off: %s", why)
        return False
    import torch

    if deterministic:
        torch._inductor.config.fallback_random = True
    for block in model.blocks:
        block.compile(fullgraph=True, mode=mode)
    log.info(
        "train.compile: %d blocks compiled in place, mode %s (one graph, built at the first step)",
        len(model.blocks),
        mode,
    )
    return True
