"""The int8/fp8/int4 wire formats (sbatch_gen.train.xr.scaled) against a reference written here: exact object
sizes, rounding within the documented bounds, the same decoded bits whoever decodes, and no NaN on the
wire."""

from __future__ import annotations

import math

import pytest
import torch

from sbatch_gen.train.xr import scaled
from sbatch_gen.train.xr.errors import XRError
from sbatch_gen.train.xr.protocol import ITEMSIZE, QBLOCK, wire_nbytes

WIRES = ["int8", "fp8", "int4"]


def _data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # blocks of very different magnitudes: each gets its own scale
    mags = torch.logspace(-6, 2, math.ceil(n / QBLOCK)).repeat_interleave(QBLOCK)[:n]
    return torch.randn(n, generator=g) * mags


def _reference_int(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of QBLOCK: scale = amax/qmax, round half to even, times the scale (float64 then fp32).
    Returns (the decoded values, the integer values)."""
    out, ints = torch.empty_like(x), torch.empty(x.numel(), dtype=torch.int64)
    for lo in range(0, x.numel(), QBLOCK):
        b = x[lo : lo + QBLOCK].double()
        scale = torch.tensor(float(b.abs().max()) / qmax, dtype=torch.float32).double()
        scale = scale if scale > 0 else torch.tensor(1.0, dtype=torch.float64)
        q = torch.round(b / scale).clamp(-qmax, qmax)
        out[lo : lo + QBLOCK] = (q * scale).float()
        ints[lo : lo + QBLOCK] = q.long()
    return out, ints


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("n", [1, QBLOCK - 1, QBLOCK, 3 * QBLOCK + 17])
def test_objects_are_exactly_the_values_plus_one_fp32_scale_per_block(wire, n):
    buf = scaled.encode(_data(n), wire)
    values = n if wire != "int4" else (n + 1) // 2  # int4: two values per byte, an odd count padded
    assert len(buf) == wire_nbytes(wire, n) == values + 4 * math.ceil(n / QBLOCK)
    # half (int4: a quarter) of bf16's bytes, rounded up, plus the scales
    share = 4 if wire == "int4" else 2
    assert values == math.ceil(n * ITEMSIZE["bf16"] / share)


@pytest.mark.parametrize(("wire", "qmax"), [("int8", 127), ("int4", 7)])
def test_ints_round_as_the_reference_within_half_a_step_of_each_block(wire, qmax):
    x = _data(5 * QBLOCK + 3)
    y = scaled.decode(scaled.encode(x, wire), x.numel(), wire)
    ref, _ = _reference_int(x, qmax)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)
    for lo in range(0, x.numel(), QBLOCK):
        b, d = x[lo : lo + QBLOCK], y[lo : lo + QBLOCK]
        step = float(b.abs().max()) / qmax
        assert float((d - b).abs().max()) <= step / 2 * (1 + 1e-5)


@pytest.mark.parametrize("n", [1, 2, QBLOCK + 1])
def test_int4_packs_two_values_per_byte_low_nibble_first(n):
    x = _data(n, seed=7)
    buf = bytes(scaled.encode(x, "int4"))
    _, q = _reference_int(x, 7)
    nibbles = (q + 8).tolist() + ([8] if n % 2 else [])  # stored as value + 8; the padding nibble is 8
    want = bytes(lo | (hi << 4) for lo, hi in zip(nibbles[0::2], nibbles[1::2], strict=True))
    assert buf[4 * math.ceil(n / QBLOCK) :] == want


def test_fp8_keeps_each_value_to_its_three_mantissa_bits():
    x = _data(4 * QBLOCK)
    y = scaled.decode(scaled.encode(x, "fp8"), x.numel(), "fp8")
    for lo in range(0, x.numel(), QBLOCK):
        b, d = x[lo : lo + QBLOCK], y[lo : lo + QBLOCK]
        scale = float(b.abs().max()) / 448
        # e4m3: relative error <= 2^-4 for normal values; below 2^-6 (x scale) the subnormal step 2^-9
        bound = torch.maximum(b.abs() * 2**-4, torch.full_like(b, scale * 2**-10))
        assert bool(((d - b).abs() <= bound * (1 + 1e-5)).all())
        assert float(d.abs().max()) == pytest.approx(float(b.abs().max()), rel=1e-6)  # amax maps to 448


@pytest.mark.parametrize("wire", WIRES)
def test_zero_blocks_and_the_extremes_decode_without_nan(wire):
    x = torch.zeros(2 * QBLOCK + 5)
    x[QBLOCK] = 3.0e38  # near the fp32 maximum: the scale stays finite
    x[QBLOCK + 1] = -3.0e38
    x[2 * QBLOCK] = 1e-40  # a subnormal block
    y = scaled.decode(scaled.encode(x, wire), x.numel(), wire)
    assert bool(torch.isfinite(y).all())
    assert bool((y[:QBLOCK] == 0).all())
    assert float(y[QBLOCK]) == pytest.approx(3.0e38, rel=1e-6) and float(y[QBLOCK + 1]) < 0


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_diverged_payload_is_refused_not_published(wire, bad):
    x = _data(3 * QBLOCK)
    x[QBLOCK + 7] = bad
    with pytest.raises(XRError, match=rf"NaN or infinite values \(elements {QBLOCK}\.\.{2 * QBLOCK - 1}"):
        scaled.encode(x, wire)


@pytest.mark.parametrize("wire", WIRES)
def test_the_same_bytes_decode_to_the_same_bits_and_a_wrong_length_is_refused(wire):
    x = _data(2 * QBLOCK + 9, seed=3)
    buf = bytearray(scaled.encode(x, wire))  # as a download hands it over: writable
    a = scaled.decode(buf, x.numel(), wire)
    b = scaled.decode(bytearray(buf), x.numel(), wire)  # another copy of the same bytes
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(XRError, match="bytes, got"):
        scaled.decode(buf[:-1], x.numel(), wire)
    with pytest.raises(ValueError, match="not a scaled wire dtype"):
        scaled.encode(x, "bf16")


@pytest.mark.parametrize("wire", WIRES)
def test_reused_buffers_holding_garbage_give_the_same_bytes_and_values(wire):
    """The exchange passes its buffers from round to round: what they held before must not leak in."""
    x = _data(3 * QBLOCK + 11, seed=5)
    fresh = bytes(scaled.encode(x, wire))
    scratch = torch.full((8 * QBLOCK,), float("nan"))
    out = torch.full((wire_nbytes(wire, x.numel()),), 0xAB, dtype=torch.uint8)
    assert bytes(scaled.encode(x, wire, scratch=scratch, out=out)) == fresh
    dec = torch.full((8 * QBLOCK,), float("inf"))
    got = scaled.decode(bytearray(fresh), x.numel(), wire, out=dec)
    assert got.data_ptr() == dec.data_ptr()  # decoded in place
    assert torch.equal(
        got.view(torch.int32), scaled.decode(bytearray(fresh), x.numel(), wire).view(torch.int32)
    )
