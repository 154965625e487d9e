"""``model.safetensors``: the run's final parameters, the same bytes wherever the same bits were trained.

safetensors writes the header's ``__metadata__`` keys in an order that differs from process to process, so
two regions that end on bit-identical parameters would still write different files, and a checksum
comparison (``sha256sum eu/model.safetensors us/model.safetensors``) would report a false mismatch. The
export therefore rewrites the header canonically: JSON with sorted keys and compact separators, padded
with spaces to a multiple of 8 bytes as the format prescribes. The data section is left as written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("sbatch_gen.train")

HEADER_LEN = 8  # the little-endian u64 before the JSON header
ALIGN = 8  # the data section starts at a multiple of this


def canonical_header(path: Path) -> None:
    """Rewrite the JSON header of the safetensors file at ``path`` canonically (in place when its length
    does not change, which is the usual case: the same keys and values in another order)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(HEADER_LEN), "little")
        header = json.loads(f.read(n))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-(HEADER_LEN + len(text)) % ALIGN)
        if len(text) == n:
            f.seek(HEADER_LEN)
            f.write(text)
            return
    alt = path.with_name(path.name + ".canonical")
    try:
        with open(path, "rb") as src, open(alt, "wb") as dst:
            dst.write(len(text).to_bytes(HEADER_LEN, "little"))
            dst.write(text)
            src.seek(HEADER_LEN + n)
            shutil.copyfileobj(src, dst, 16 << 20)
        os.replace(alt, path)
    finally:
        alt.unlink(missing_ok=True)


def save_model(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``tensors`` (contiguous, on the CPU) and ``metadata`` as a safetensors file with a canonical header."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    canonical_header(path)


def export_model(state: dict[str, torch.Tensor], step: int, model_cfg: dict, run_dir: Path) -> None:
    """rank 0, at the end: ``run_dir/model.safetensors``, the model's whole tensors (``state``, a state
    dict) on the CPU with the step and the model config as metadata."""
    from ..fsutil import atomic_path

    out = run_dir / "model.safetensors"
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    meta = {"step": str(step), "model": json.dumps(model_cfg, sort_keys=True)}
    with atomic_path(out, fsync=False) as tmp:
        save_model(tensors, tmp, meta)  # the same bytes in every region that ends on the same bits
    log.info("exported %d tensors to %s", len(tensors), out)
