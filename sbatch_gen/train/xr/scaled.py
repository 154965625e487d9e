"""The scaled wire formats of deltas and gradients: ``int8``, ``fp8`` (e4m3) and ``int4``, one fp32 scale
per :data:`~.protocol.QBLOCK` elements.

A shard of ``n`` elements is ``ceil(n / QBLOCK)`` fp32 scales (little-endian), then the values: ``n``
bytes (int8, fp8: half of bf16's bytes plus the scales, 1.6% at QBLOCK 256), or ``ceil(n / 2)`` bytes of
two 4-bit values each (int4: element ``2i`` in the low nibble, ``2i + 1`` in the high one, each stored as
``value + 8``; a quarter of bf16's bytes plus the scales, 3.1%). Exactly :func:`~.protocol.wire_nbytes`
bytes.

Encoding runs once, on the node leader that owns the shard: per block ``scale = amax / QMAX`` (1 for a
block of zeros), ``value = x / scale`` rounded to nearest (int8, int4: half to even, clamped to +-127 or
+-7; fp8: clamped to +-448, then the e4m3 conversion). Decoding is ``float(value) * scale``: an exact
conversion and one multiplication, so every region, the encoding one included, decodes the same bytes to
the same fp32 bits on any device. The regions then average those decoded values (:mod:`.kernels`).

A block holding a NaN or an infinity cannot be scaled: encoding raises :class:`~.errors.XRError` (the
region's training diverged) instead of publishing garbage that every region would apply.
"""

from __future__ import annotations

import math

import torch

from .errors import XRError
from .protocol import QBLOCK, SCALED, wire_nbytes

QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # the largest magnitude a scaled value takes
_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
NIBBLE_BIAS = 8  # an int4 value v in -7..7 is stored as the nibble v + 8 (1..15; a padding nibble is 8)

__all__ = ["QMAX", "decode", "encode", "padded"]


def padded(n: int) -> int:
    """Elements of the fp32 block buffer a shard of ``n`` elements is encoded or decoded in (whole blocks)."""
    return math.ceil(n / QBLOCK) * QBLOCK


def _check(wire: str) -> None:
    if wire not in SCALED:
        raise ValueError(f"not a scaled wire dtype: {wire!r} (one of {sorted(SCALED)})")


def _buffer(buf: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The first ``n`` elements of ``buf`` when it is large enough (and of the dtype and device), else a new one."""
    if buf is not None and buf.numel() >= n and buf.dtype == dtype and buf.device == torch.device(device):
        return buf[:n]
    return torch.empty(n, dtype=dtype, device=device)


@torch.no_grad()
def encode(
    x: torch.Tensor, wire: str, *, scratch: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> memoryview:
    """The wire bytes of the fp32 vector ``x`` (any device), in host memory. ``scratch`` (fp32, on ``x``'s
    device) and ``out`` (uint8, host) are reused when large enough: fresh memory costs more than the math."""
    _check(wire)
    n = x.numel()
    nb = math.ceil(n / QBLOCK)
    flat = _buffer(scratch, nb * QBLOCK, torch.float32, x.device)
    flat[:n].copy_(x.reshape(-1))
    flat[n:].zero_()
    blocks = flat.view(nb, QBLOCK)
    amax = blocks.abs().amax(dim=1)
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise XRError(
            f"the payload holds NaN or infinite values (elements {first * QBLOCK}..{(first + 1) * QBLOCK - 1} "
            f"of the shard): training diverged in this region; nothing was published"
        )
    scale = amax / QMAX[wire]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = blocks.div_(scale[:, None])
    dst = _buffer(out, wire_nbytes(wire, n), torch.uint8, "cpu")
    dst[: 4 * nb].copy_(scale.view(torch.uint8))
    if wire == "int4":  # whole blocks hold an even count; the padding (zeros) packs as nibbles of 8
        u = v.round_().clamp_(-QMAX[wire], QMAX[wire]).add_(NIBBLE_BIAS).reshape(-1).to(torch.uint8)
        dst[4 * nb :].copy_((u[0::2] | (u[1::2] << 4))[: (n + 1) // 2])
        return dst.numpy().data
    if wire == "int8":
        q = v.round_().clamp_(-QMAX[wire], QMAX[wire]).to(torch.int8)
    else:
        q = v.clamp_(-QMAX[wire], QMAX[wire]).to(torch.float8_e4m3fn)
    dst[4 * nb :].copy_(q.reshape(-1)[:n].view(torch.uint8))
    return dst.numpy().data


@torch.no_grad()
def decode(
    buf, n: int, wire: str, device: torch.device | str = "cpu", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 values of a shard of ``n`` elements from its wire bytes ``buf``, on ``device``. ``out`` (fp32,
    on ``device``) is reused when large enough."""
    _check(wire)
    nb = math.ceil(n / QBLOCK)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    if raw.numel() != wire_nbytes(wire, n):
        raise XRError(f"a {wire} shard of {n} elements is {wire_nbytes(wire, n)} bytes, got {raw.numel()}")
    scale = raw[: 4 * nb].clone().view(torch.float32).to(device)
    flat = _buffer(out, nb * QBLOCK, torch.float32, device)
    if wire == "int4":
        packed = raw[4 * nb :].to(device)
        nibbles = torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(-1)[:n]
        flat[:n].copy_(nibbles)
        flat[:n].sub_(NIBBLE_BIAS)  # exact: small integers
    else:
        flat[:n].copy_(
            raw[4 * nb :].view(_DTYPE[wire]).to(device)
        )  # exact: every int8 and e4m3 value is an fp32
    flat[n:].zero_()
    flat.view(nb, QBLOCK).mul_(scale[:, None])  # one rounding per element
    return flat[:n]
