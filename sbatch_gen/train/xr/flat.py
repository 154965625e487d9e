"""The model's trainable parameters as one flat vector: views, gathers and scatters.

The outer sync works on flat fp32 buffers (``theta_outer``, momentum, the average), held by the region's
leaders only; :class:`FlatParams` moves data between them and the parameters (or their ``.grad``) by
offset, without a per-step allocation, and names the tensors the other ranks receive by broadcast.
"""

from __future__ import annotations

import bisect
import hashlib
import json

import torch
from torch import nn


def _strip(name: str) -> str:
    for pre in ("module.", "_orig_mod."):
        while name.startswith(pre):
            name = name[len(pre) :]
    return name.replace("._orig_mod.", ".").replace(".module.", ".")


def layout_fingerprint(model: nn.Module) -> str:
    items = [(_strip(n), list(p.shape), str(p.dtype)) for n, p in model.named_parameters() if p.requires_grad]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _sharded(p: torch.Tensor) -> str | None:
    """Why ``p`` is not this rank's full copy of the parameter (a DTensor, FSDP's flat parameter), or None."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return f"a DTensor placed as {list(p.placements)}"
    if type(p).__name__ == "FlatParameter":
        return "an FSDP flat parameter"
    return None


class FlatParams:
    def __init__(self, model: nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in named:
            why = _sharded(p)
            if why is not None:
                raise ValueError(
                    f"parameter {_strip(name)} is {why}: the cross-region sync needs every rank of the region "
                    "to hold the whole model (DDP, or one process per region); FSDP and tensor-parallel "
                    "sharding are not supported"
                )
        self.params = [p for _, p in named]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.layout = layout_fingerprint(model)

    def views(self, flat: torch.Tensor):
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            yield p, flat[lo:hi].view(p.shape)

    @torch.no_grad()
    def gather(self, out: torch.Tensor) -> torch.Tensor:
        for p, v in self.views(out):
            v.copy_(p.detach())
        return out

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor) -> None:
        for p, v in self.views(flat):
            p.copy_(v)

    def direct(self, device: torch.device) -> bool:
        """Can slices of flat buffers on ``device`` be copied straight into the parameters' storage?"""
        return all(p.device == device and p.is_contiguous() for p in self.params)

    @torch.no_grad()
    def scatter_range(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat[lo:hi]`` into the parameters that hold those elements (contiguous, same device)."""
        i = bisect.bisect_right(self.offsets, lo) - 1
        while i < len(self.params) and self.offsets[i] < hi:
            off = self.offsets[i]
            a, b = max(lo, off), min(hi, self.offsets[i + 1])
            self.params[i].detach().view(-1)[a - off : b - off].copy_(flat[a:b])
            i += 1

    @torch.no_grad()
    def delta_into(self, theta_outer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = theta_outer - theta_local`` (the outer "gradient"; note the sign), in one pass when the
        parameters live on the buffers' device."""
        if not self.direct(out.device):
            return torch.sub(theta_outer, self.gather(out), out=out)
        for p, lo, hi in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            torch.sub(theta_outer[lo:hi], p.detach().view(-1), out=out[lo:hi])
        return out

    @torch.no_grad()
    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        for p, v in self.views(out):
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad.detach())
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The parameters' data (detached, sharing storage): what a broadcast writes into."""
        return [p.detach() for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        """The parameters' ``.grad`` (zeros where there is none yet): what a broadcast writes into."""
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    @torch.no_grad()
    def scatter_grads(self, flat: torch.Tensor) -> None:
        for p, v in self.views(flat):
            if p.grad is None:
                p.grad = v.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(v)
