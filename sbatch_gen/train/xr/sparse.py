"""The sparse wire format of DiLoCo deltas (``payload_dtype: sparse``): per chunk of a shard, the top-k of
its elements by magnitude, each as its index and a 2-bit value.

A shard of ``n`` elements is cut into ``ceil(n / C)`` chunks of ``C`` elements (``sparse_chunk``, a power
of two; the last chunk padded with zeros) and every chunk is ``protocol.sparse_chunk_nbytes(C, k)`` bytes, one after the
other, so the chunks holding any elements lie in one known byte range:

- ``hi``, ``lo``: two fp32 magnitudes (little-endian), the kept values of rank ``k // 4`` and
  ``3k // 4`` (by magnitude, largest first; in a last chunk of ``r < k`` elements, ``r // 4`` and
  ``3r // 4``): order statistics, values the chunk itself holds;
- the ``k`` indices inside the chunk, ascending, ``log2(C)`` bits each, packed least significant bit
  first (``ceil(k * log2(C) / 8)`` bytes);
- the ``k`` 2-bit codes in the same order (``ceil(k / 4)`` bytes, same packing): bit 0 the sign (1:
  negative), bit 1 the level (1: ``hi``, 0: ``lo``). A kept value takes the level nearest to its
  magnitude (``|x| - lo > hi - |x|``: ``hi``; a tie goes to ``lo``).

Decoding is a selection and a negation, no arithmetic: ``value = +-hi`` or ``+-lo`` at the chunk's indices,
zero elsewhere. Every region, the encoding one included, decodes the same bytes to the same fp32 bits on
any device. With ``C = 4096`` and 1% density (``k = 41``) a chunk is 8 + 62 + 11 = 81 bytes: 0.0198 B per
element, 1/101 of bf16's.

What was not sent (the other elements, and the quantisation error of the kept ones) stays in the
region's error-feedback buffer (:mod:`.diloco`), so :func:`encode` is a pure function of its input: the
buffer is the caller's.

A decoder refuses, in one line naming the chunk, bytes that an encoder never writes: a wrong length,
non-finite or negative magnitudes, indices that are not strictly ascending (a duplicate), or indices in the
padding of the last chunk where the encoder had real elements to pick. A padding index holds no value:
it is dropped.
"""

from __future__ import annotations

import math

import torch

from .errors import XRError
from .protocol import SPARSE_HEADER as HEADER
from .protocol import sparse_chunk_nbytes as chunk_nbytes

__all__ = ["decode", "encode", "kept"]


def kept(chunk: int, density: float) -> int:
    """The entries kept per chunk of ``chunk`` elements at ``density`` (at least 1, at most the chunk)."""
    return max(1, min(chunk, round(density * chunk)))


def _bits(chunk: int) -> int:
    return chunk.bit_length() - 1


def _pack(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of non-negative integers below 2**bits (bits <= 16) -> rows of bytes, the values one after the
    other, least significant bit first: value i at bits ``i*bits ..`` of its row. Each value spans at most
    3 bytes; values share no bit, so adding their byte parts is OR-ing them (exact, any order)."""
    rows, k = v.shape
    nbytes = math.ceil(k * bits / 8)
    at = torch.arange(k, dtype=torch.int32, device=v.device) * bits
    byte, shift = at // 8, at % 8
    w = v.to(torch.int32) << shift  # the value's bits placed in a 3-byte little-endian word
    out = torch.zeros(rows, nbytes + 2, dtype=torch.int32, device=v.device)
    for j in range(3):
        out.index_add_(1, byte + j, (w >> (8 * j)) & 0xFF)
    return out[:, :nbytes].to(torch.uint8)


def _unpack(raw: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack`: rows of bytes -> rows of ``k`` integers (int64)."""
    rows = raw.shape[0]
    b = torch.zeros(rows, raw.shape[1] + 2, dtype=torch.int32, device=raw.device)
    b[:, : raw.shape[1]] = raw
    at = torch.arange(k, dtype=torch.int32, device=raw.device) * bits
    byte, shift = at // 8, at % 8
    w = b[:, byte] | (b[:, byte + 1] << 8) | (b[:, byte + 2] << 16)
    return ((w >> shift) & ((1 << bits) - 1)).to(torch.int64)


@torch.no_grad()
def encode(x: torch.Tensor, chunk: int, k: int, *, scratch: torch.Tensor | None = None) -> memoryview:
    """The wire bytes of the fp32 vector ``x`` (any device), in host memory. Deterministic for the same
    input on the same device (top-k, order statistics, comparisons: no sums). ``scratch`` (fp32, on ``x``'s
    device, whole chunks) is reused when large enough."""
    n = x.numel()
    nc = math.ceil(n / chunk)
    src = x.reshape(-1)
    if scratch is not None and scratch.numel() >= nc * chunk and scratch.device == x.device:
        mag = scratch[: nc * chunk]
    else:
        mag = torch.empty(nc * chunk, dtype=torch.float32, device=x.device)
    torch.abs(src, out=mag[:n])
    mag[n:] = -1.0  # the padding is picked last: only when a short last chunk has fewer than k
    rows = mag.view(nc, chunk)
    kv, idx = rows.topk(k, dim=1, sorted=True)  # largest first; a NaN or an infinity first of all
    bad = ~torch.isfinite(kv[:, 0])
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise XRError(
            f"the payload holds NaN or infinite values (element {j * chunk + int(idx[j, 0])} of the shard): "
            "training diverged in this region; nothing was published"
        )
    kv.clamp_(min=0.0)  # (the padding's magnitude is 0)
    # the levels: the kept real values of rank r // 4 and 3r // 4 (r = k, but in a last chunk shorter than k)
    r = torch.full((nc, 1), k, dtype=torch.int64, device=x.device)
    r[-1] = min(k, n - (nc - 1) * chunk)
    hi, lo = kv.gather(1, r // 4).squeeze(1), kv.gather(1, (3 * r) // 4).squeeze(1)
    level = (kv - lo[:, None]) > (hi[:, None] - kv)
    at = idx + torch.arange(0, nc * chunk, chunk, device=x.device)[:, None]
    real = at < n
    sign = (src[at.clamp_(max=n - 1)] < 0) & real
    idx, order = idx.sort(dim=1)  # ascending indices (the decoder refuses anything else)
    code = (sign.long() | (level.long() << 1)).gather(1, order)
    head = torch.stack((hi, lo), dim=1).contiguous().view(torch.uint8).reshape(nc, HEADER)
    out = torch.cat((head, _pack(idx, _bits(chunk)), _pack(code, 2)), dim=1)
    return out.reshape(-1).cpu().numpy().data


@torch.no_grad()
def decode(
    buf,
    n: int,
    chunk: int,
    k: int,
    device: torch.device | str = "cpu",
    *,
    out: torch.Tensor | None = None,
    what: str = "a sparse shard",
) -> torch.Tensor:
    """The fp32 values of a shard of ``n`` elements from its wire bytes ``buf``, on ``device``; ``out``
    (fp32, on ``device``, at least ``ceil(n / chunk) * chunk`` elements) is reused when given. ``what``
    names the shard in a refusal."""
    nc = math.ceil(n / chunk)
    per = chunk_nbytes(chunk, k)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if n and len(buf) else torch.empty(0, dtype=torch.uint8)
    if raw.numel() != nc * per:
        raise XRError(
            f"{what}: a sparse shard of {n} elements ({nc} chunks of {per} bytes) is {nc * per} bytes, "
            f"got {raw.numel()}"
        )
    rows = raw.view(nc, per).to(device)
    hl = rows[:, :HEADER].reshape(-1).clone().view(torch.float32).view(nc, 2)
    bad = ~torch.isfinite(hl).all(dim=1) | (hl < 0).any(dim=1)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise XRError(f"{what}: chunk {j} has magnitudes {hl[j].tolist()}: not finite and >= 0")
    ib = math.ceil(k * _bits(chunk) / 8)
    idx = _unpack(rows[:, HEADER : HEADER + ib], k, _bits(chunk))
    code = _unpack(rows[:, HEADER + ib :], k, 2)
    if k > 1:
        bad = (idx[:, 1:] <= idx[:, :-1]).any(dim=1)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise XRError(f"{what}: chunk {j} has duplicate or unordered indices")
    last = n - (nc - 1) * chunk
    inside = int((idx[-1] < last).sum()) if nc else 0
    if nc and inside != min(k, last):
        raise XRError(
            f"{what}: chunk {nc - 1} (the last, {last} elements) has {k - inside} indices out of range"
        )
    mag = torch.where((code >> 1).bool(), hl[:, :1], hl[:, 1:])
    val = torch.where((code & 1).bool(), -mag, mag)
    dense = (
        out[: nc * chunk] if out is not None else torch.empty(nc * chunk, dtype=torch.float32, device=device)
    )
    dense.zero_()
    dense.view(nc, chunk).scatter_(1, idx, val)
    return dense[:n]
