"""OuterSync in one process per region (regions run as threads, no process group): the algorithms
against references computed here, independently, in float64."""

from __future__ import annotations

import math
import threading
import zlib

import pytest
import torch
from torch import nn

from sbatch_gen.train.dist import DistInfo
from sbatch_gen.train.xr.errors import XRLayoutError, XRTimeout
from sbatch_gen.train.xr.modes import create
from sbatch_gen.train.xr.protocol import QBLOCK
from sbatch_gen.xr_options import CrossRegion, FsTransport

from .concurrent import in_threads as run_in_threads

pytestmark = pytest.mark.slow  # outer steps on real model sizes

REGIONS = ["eu", "us"]
W_TRUE = torch.tensor([[1.0], [-2.0], [0.5], [3.0], [-1.0], [0.25]])


_INIT_LOCK = threading.Lock()  # regions run as threads and nn.Linear draws from torch's global RNG


def model(seed: int, hidden: int = 12) -> nn.Module:
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def batch(region: str, step: int, n: int = 32):
    # a stable seed: hash() of a str differs from process to process (PYTHONHASHSEED), and so would the data
    g = torch.Generator().manual_seed(zlib.crc32(f"{region}:{step}".encode()))
    shift = 0.5 if region == "eu" else -0.5  # the regions see different data
    x = torch.randn(n, 6, generator=g) + shift
    return x, x @ W_TRUE


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def global_loss(m: nn.Module) -> float:
    with torch.no_grad():
        return sum(((m(x) - y) ** 2).mean().item() for x, y in (batch(r, 10_000, 512) for r in REGIONS)) / 2


def xr_for(region, root, **kw) -> CrossRegion:
    base = dict(
        enabled=True,
        run_id="t",
        region=region,
        regions=REGIONS,
        inner_steps=4,
        transport=FsTransport(root=str(root)),
        timeout_s=30,
        shard_mb=0.001,
        threads=4,
    )
    base.update(kw)
    return CrossRegion(**base)


def make(region, root, seed=None, log=None, **kw):
    m = model(seed if seed is not None else (1 if region == "eu" else 2))
    s = create(
        xr_for(region, root, **kw),
        m,
        torch.device("cpu"),
        DistInfo(),
        None,
        log,
        poll_min_s=0.005,
        poll_max_s=0.05,
    )
    return m, s


def in_threads(fn, regions=REGIONS):
    return run_in_threads(fn, regions)


def inner_steps(m, opt, region, steps):
    for step in steps:
        x, y = batch(region, step)
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()


def train(region, root, rounds, *, tokens=None, hooks=None, lr=0.05, **kw):
    """Hand-written inner loop (SGD) with the sync; returns a record per round."""
    m, s = make(region, root, **kw)
    s.align(0)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    H = s.xr.inner_steps
    rec = {"theta0": flat(m), "rounds": []}
    for step in range(1, rounds * H + 1):
        inner_steps(m, opt, region, [step])
        before = flat(m)
        theta_before = s.theta_outer.clone()
        t = s.after_optimizer_step(step, (tokens or {}).get(region, 32))
        if t is not None:
            rec["rounds"].append(
                dict(
                    local=before,
                    theta_before=theta_before,
                    after=flat(m),
                    timings=t,
                    theta_outer=s.theta_outer.clone(),
                    momentum=s.momentum.clone(),
                    loss=global_loss(m),
                )
            )
            if hooks:
                hooks(region, step, m, s)
    rec["model"], rec["sync"] = m, s
    return rec


def test_align_makes_regions_identical_and_writes_the_model(tmp_path):
    events = []
    ms = in_threads(lambda r: make(r, tmp_path, log=events.append))
    assert not torch.equal(flat(ms["eu"][0]), flat(ms["us"][0]))
    in_threads(lambda r: ms[r][1].align(0))
    assert torch.equal(flat(ms["eu"][0]), flat(ms["us"][0]))
    assert torch.equal(ms["us"][1].theta_outer, flat(ms["eu"][0]))
    aligns = [e for e in events if e["event"] == "xr_align"]
    assert sorted(e["action"] for e in aligns) == ["adopted", "published"]
    assert len({e["digest"] for e in aligns}) == 1
    # the first region restarted from scratch (different init) adopts the theta0 already published
    m2, s2 = make("eu", tmp_path, seed=99)
    s2.align(0)
    assert torch.equal(flat(m2), flat(ms["eu"][0]))
    # aligned (e.g. resumed): a no-op, even with no peer around
    before = flat(m2)
    s2.align(5)
    assert torch.equal(flat(m2), before)


def test_layout_mismatch_is_a_clear_error(tmp_path):
    def go(r):
        m = model(1, hidden=12 if r == "eu" else 13)
        s = create(
            xr_for(r, tmp_path, timeout_s=5),
            m,
            torch.device("cpu"),
            DistInfo(),
            None,
            None,
            poll_min_s=0.005,
            poll_max_s=0.05,
        )
        s.align(0)

    with pytest.raises(XRLayoutError, match=r"region 'eu' published a mismatched payload.*numel"):
        in_threads(go)


def test_lr1_momentum0_equals_parameter_averaging(tmp_path):
    recs = in_threads(lambda r: train(r, tmp_path, 3, outer_lr=1.0, outer_momentum=0.0, payload_dtype="fp32"))
    for k in range(3):
        eu, us = recs["eu"]["rounds"][k], recs["us"]["rounds"][k]
        avg = (eu["local"].double() + us["local"].double()) / 2  # reference: plain parameter averaging
        torch.testing.assert_close(eu["after"].double(), avg, rtol=0, atol=2e-6)
        assert torch.equal(eu["after"], us["after"])  # bitwise identical regions


def test_nesterov_matches_the_formula_with_token_weights(tmp_path):
    lr, mu, tokens = 0.7, 0.9, {"eu": 100, "us": 300}
    recs = in_threads(
        lambda r: train(r, tmp_path, 3, tokens=tokens, outer_lr=lr, outer_momentum=mu, payload_dtype="fp32")
    )
    theta = recs["eu"]["theta0"].double()
    m = torch.zeros_like(theta)
    w = {"eu": 100 * 4 / (400 * 4), "us": 300 * 4 / (400 * 4)}  # tokens over the round's 4 steps
    for k in range(3):
        g = sum(w[r] * (theta - recs[r]["rounds"][k]["local"].double()) for r in REGIONS)
        m = mu * m + g
        theta = theta - lr * (g + mu * m)
        for r in REGIONS:
            got = recs[r]["rounds"][k]
            torch.testing.assert_close(got["theta_outer"].double(), theta, rtol=0, atol=1e-5)
            torch.testing.assert_close(got["momentum"].double(), m, rtol=0, atol=1e-5)
            assert torch.equal(got["after"], got["theta_outer"])  # the model took theta_outer
        assert torch.equal(recs["eu"]["rounds"][k]["after"], recs["us"]["rounds"][k]["after"])
        assert recs["eu"]["rounds"][k]["timings"]["xr_tokens"] == 1600


def test_outer_step_decreases_the_loss_and_regions_stay_bitwise_equal(tmp_path):
    # defaults: bf16 payloads, lr 0.7, momentum 0.9
    recs = in_threads(lambda r: train(r, tmp_path, 4, lr=0.02))
    losses = [r["loss"] for r in recs["eu"]["rounds"]]
    ref = model(1)  # the loss at theta0
    with torch.no_grad():
        for p, v in zip(
            ref.parameters(), recs["eu"]["theta0"].split([p.numel() for p in ref.parameters()]), strict=True
        ):
            p.copy_(v.view_as(p))
    assert losses[0] < global_loss(ref)
    assert losses[-1] < losses[0] * 0.7, losses
    for a, b in zip(recs["eu"]["rounds"], recs["us"]["rounds"], strict=True):
        assert torch.equal(a["after"], b["after"])
        assert torch.equal(a["momentum"], b["momentum"])


def test_timings_add_up_and_bytes_are_counted(tmp_path):
    recs = in_threads(lambda r: train(r, tmp_path, 1))
    t = recs["eu"]["rounds"][0]["timings"]
    parts = [
        "xr_upload_s",
        "xr_wait_s",
        "xr_download_s",
        "xr_reduce_s",
        "xr_broadcast_s",
        "xr_outer_step_s",
        "xr_cleanup_s",
    ]
    assert all(t[k] >= 0 for k in parts)
    assert abs(sum(t[k] for k in parts) - t["xr_total_s"]) < 1e-9
    numel = recs["eu"]["sync"].numel
    assert t["xr_bytes_up"] == numel * 2 and t["xr_bytes_down"] == numel * 2  # bf16, one peer
    assert t["xr_round"] == 1 and t["xr_step"] == 4 and t["xr_reused"] is False


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8", "fp8", "int4"])
def test_shard_objects_are_exactly_their_documented_size(tmp_path, dtype):
    """numel x itemsize; int8/fp8: one byte per element, int4 half a byte (rounded up), plus one fp32 scale
    per QBLOCK of the shard."""
    shard_mb = 0.00002 if dtype == "int4" else 0.00005  # several shards; int4's last one an odd count
    recs = in_threads(lambda r: train(r, tmp_path, 1, payload_dtype=dtype, shard_mb=shard_mb))
    s = recs["eu"]["sync"]
    files = sorted((tmp_path / "t" / "r000001" / "eu").iterdir())
    assert len(files) == len(s.ex.plan) > 1
    itemsize = {"bf16": 2, "fp32": 4, "int8": 1, "fp8": 1, "int4": 0.5}[dtype]
    for f, (lo, hi) in zip(files, s.ex.plan.bounds, strict=True):
        scales = 4 * math.ceil((hi - lo) / QBLOCK) if dtype in ("int8", "fp8", "int4") else 0
        assert f.stat().st_size == math.ceil((hi - lo) * itemsize) + scales
    t = recs["eu"]["rounds"][0]["timings"]
    assert t["xr_bytes_up"] == sum(f.stat().st_size for f in files) == t["xr_bytes_down"]


QMAX = {"int8": 127, "int4": 7}


def _dequantized(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """The reference int8/int4 wire round trip, per block of QBLOCK, written here in float64."""
    out = torch.empty_like(x, dtype=torch.float64)
    for lo in range(0, x.numel(), QBLOCK):
        b = x[lo : lo + QBLOCK].double()
        scale = float(torch.tensor(float(b.abs().max()) / qmax, dtype=torch.float32)) or 1.0
        out[lo : lo + QBLOCK] = torch.round(b / scale).clamp(-qmax, qmax) * scale
    return out


@pytest.mark.parametrize("dtype", ["int8", "fp8", "int4"])
def test_scaled_payloads_keep_regions_bitwise_equal_and_follow_the_formula(tmp_path, dtype):
    """Every region averages the same decoded deltas: identical bits, and (int8, int4) the Nesterov step on
    the reference's dequantized deltas."""
    lr, mu, tokens = 0.7, 0.9, {"eu": 100, "us": 300}
    recs = in_threads(
        lambda r: train(r, tmp_path, 3, tokens=tokens, outer_lr=lr, outer_momentum=mu, payload_dtype=dtype)
    )
    theta = recs["eu"]["theta0"].double()
    m = torch.zeros_like(theta)
    w = {"eu": 0.25, "us": 0.75}
    for k in range(3):
        eu, us = recs["eu"]["rounds"][k], recs["us"]["rounds"][k]
        assert torch.equal(eu["after"], us["after"]) and torch.equal(eu["momentum"], us["momentum"])
        if dtype in QMAX:
            g = sum(
                w[r]
                * _dequantized(
                    recs[r]["rounds"][k]["theta_before"] - recs[r]["rounds"][k]["local"], QMAX[dtype]
                )
                for r in REGIONS
            )
            m = mu * m + g
            theta = theta - lr * (g + mu * m)
            torch.testing.assert_close(eu["theta_outer"].double(), theta, rtol=0, atol=1e-5)
    assert recs["eu"]["rounds"][-1]["loss"] < recs["eu"]["rounds"][0]["loss"]


def test_scaled_payloads_need_raw_serialization(tmp_path):
    with pytest.raises(ValueError, match="payload_dtype int8 needs serialization: raw"):
        xr_for("eu", tmp_path, payload_dtype="int8", serialization="torch_save")


def test_failed_exchange_changes_nothing(tmp_path):
    m, s = make("eu", tmp_path, timeout_s=0.3, regions=["eu", "us"])
    s.align(0)  # eu is the first region: publishes theta0 without waiting
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    inner_steps(m, opt, "eu", range(1, 5))
    local, theta, mom = flat(m), s.theta_outer.clone(), s.momentum.clone()
    with pytest.raises(
        XRTimeout,
        match=r"round r000001 \(step 4\): no quorum after 0.3 s: 1 of 2 regions published, 2 needed \(min_regions\); missing: us",
    ):
        s.after_optimizer_step(4, 32)
    assert torch.equal(flat(m), local) and torch.equal(s.theta_outer, theta) and torch.equal(s.momentum, mom)
    assert s.round == 0


def test_resume_replays_a_published_round_and_matches_the_peer(tmp_path):
    """us crashes after round 2 and resumes from its round-1 checkpoint; its re-run of round 2 sees other
    data (as after a non-deterministic restart), but it uses what it published, so it computes exactly
    the update eu computed. Then both go on to round 3 and end it bitwise equal."""
    ckpt = {}

    def save(region, step, m, s):
        if region == "us" and s.round == 1:
            ckpt["model"] = {k: v.clone() for k, v in m.state_dict().items()}
            ckpt["outer"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.state_dict().items()}

    recs = in_threads(lambda r: train(r, tmp_path, 2, hooks=save, keep_rounds=2))
    eu_m, eu_s = recs["eu"]["model"], recs["eu"]["sync"]
    after_r2 = recs["eu"]["rounds"][1]["after"]

    def eu_round3():
        opt = torch.optim.SGD(eu_m.parameters(), lr=0.05)
        inner_steps(eu_m, opt, "eu", range(9, 13))
        return eu_s.after_optimizer_step(12, 32)

    def us_resumed():
        m, s = make("us", tmp_path, seed=123, keep_rounds=2)
        m.load_state_dict(ckpt["model"])
        s.load_state_dict(ckpt["outer"])
        assert s.round == 1 and s.aligned
        s.align(4)  # no-op: aligned
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        inner_steps(m, opt, "eu", range(5, 9))  # other data than the first time
        t2 = s.after_optimizer_step(8, 32)
        got2 = flat(m)
        inner_steps(m, opt, "us", range(9, 13))
        s.after_optimizer_step(12, 32)
        return t2, got2, m

    out = {}
    th = threading.Thread(target=lambda: out.setdefault("eu", eu_round3()))
    th.start()
    t2, got2, us_m = us_resumed()
    th.join(60)
    assert t2["xr_reused"] is True and t2["xr_bytes_up"] == 0
    assert torch.equal(got2, after_r2)
    assert torch.equal(flat(us_m), flat(eu_m))


def test_grad_mode_averages_gradients_by_tokens(tmp_path):
    tokens = {"eu": 10, "us": 30}

    def go(r):
        m, s = make(r, tmp_path, sync="grad", payload_dtype="fp32", keep_rounds=2)
        s.align(0)
        x, y = batch(r, 1)
        ((m(x) - y) ** 2).mean().backward()
        own = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone()
        s.before_optimizer_step(1, tokens[r])
        avg = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone()
        t = s.after_optimizer_step(1, tokens[r])
        return own, avg, t

    res = in_threads(go)
    ref = 0.25 * res["eu"][0].double() + 0.75 * res["us"][0].double()
    for r in REGIONS:
        torch.testing.assert_close(res[r][1].double(), ref, rtol=0, atol=1e-6)
        assert res[r][2]["xr_round"] == 1 and res[r][2]["xr_tokens"] == 40
    assert torch.equal(res["eu"][1], res["us"][1])


def test_grad_mode_matches_one_process_over_both_regions_data(tmp_path):
    def go(r):
        m, s = make(r, tmp_path, sync="grad", payload_dtype="fp32", keep_rounds=2)
        s.align(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(1, 7):
            x, y = batch(r, step)
            opt.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            s.before_optimizer_step(step, 32)
            opt.step()
            s.after_optimizer_step(step, 32)
        return flat(m)

    res = in_threads(go)
    ref = model(1)  # eu's init is theta0
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(1, 7):
        xs, ys = zip(*(batch(r, step) for r in REGIONS), strict=True)
        opt.zero_grad()
        ((ref(torch.cat(xs)) - torch.cat(ys)) ** 2).mean().backward()
        opt.step()
    torch.testing.assert_close(res["eu"], flat(ref), rtol=0, atol=1e-5)
    assert torch.equal(res["eu"], res["us"])


def test_torch_save_and_rank0_only_switches_give_the_same_result(tmp_path):
    a = in_threads(lambda r: train(r, tmp_path / "a", 2, payload_dtype="fp32"))
    b = in_threads(
        lambda r: train(
            r,
            tmp_path / "b",
            2,
            payload_dtype="fp32",
            serialization="torch_save",
            node_leaders=False,
            threads=1,
            shard_mb=0,
        )
    )
    assert torch.equal(a["eu"]["rounds"][-1]["after"], b["eu"]["rounds"][-1]["after"])


def test_state_dict_roundtrip(tmp_path):
    recs = in_threads(lambda r: train(r, tmp_path, 1))
    s = recs["eu"]["sync"]
    sd = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.state_dict().items()}
    assert (
        set(sd) == {"theta_outer", "momentum", "round", "aligned", "tokens", "pending", "fragments"}
        and sd["round"] == 1
        and sd["fragments"] == 0  # not streaming
    )
    _, s2 = make("eu", tmp_path)
    s2.load_state_dict({**sd, "round": torch.tensor(1)})
    assert torch.equal(s2.theta_outer, s.theta_outer) and torch.equal(s2.momentum, s.momentum)
    assert s2.round == 1 and s2.aligned
    with pytest.raises(XRLayoutError, match="has 3 elements"):
        s2.load_state_dict({**sd, "momentum": torch.zeros(3)})


def test_outer_step_is_torch_sgd_with_nesterov():
    from sbatch_gen.train.xr.kernels import outer_nesterov_

    g = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=g)
    ref = nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    m, scratch = torch.zeros(1000), torch.empty(1000)
    for _ in range(4):
        grad = torch.randn(1000, generator=g)
        outer_nesterov_(theta, m, grad, 0.7, 0.9, scratch)
        ref.grad = grad.clone()
        sgd.step()
        torch.testing.assert_close(theta, ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [1, 7, 64, 1000, 1 << 19])
def test_blocked_elementwise_ops_have_the_bits_of_whole_buffer_ops(block):
    """The CPU runs the average and the Nesterov step block by block (cache-sized): every element goes
    through the same operations, so the result must be bit-identical to one op over the whole buffer."""
    from sbatch_gen.train.xr.kernels import nesterov_block_, outer_nesterov_, weighted_average_

    n = 10_007  # not a multiple of any block or vector width
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(3)]
    ws = [0.2, 0.3, 0.5]
    whole = torch.empty(n)
    whole.copy_(xs[0]).mul_(ws[0])
    for x, w in zip(xs[1:], ws[1:], strict=True):
        whole.add_(torch.empty(n).copy_(x).mul_(w))
    blocked = torch.full((n,), float("nan"))
    weighted_average_(blocked, xs, ws, torch.empty(min(n, block)), block=block)
    assert torch.equal(blocked, whole)

    theta, m = torch.randn(n, generator=g), torch.randn(n, generator=g)
    t1, m1, t2, m2 = theta.clone(), m.clone(), theta.clone(), m.clone()
    for mu in (0.9, 0.0):
        nesterov_block_(t1, m1, whole, 0.7, mu, torch.empty(n))
        outer_nesterov_(t2, m2, whole, 0.7, mu, torch.empty(min(n, block)), block=block)
        assert torch.equal(t1, t2) and torch.equal(m1, m2)


def test_blocks_straddling_parameters_write_theta_into_the_model(tmp_path, monkeypatch):
    """With blocks smaller than and straddling the parameters (sizes 72, 12, 12, 1), the fused
    Nesterov + copy into the model leaves every parameter equal to theta_outer, with the bits of the
    unblocked run."""
    from sbatch_gen.train.xr import exchange as exchange_mod

    whole = in_threads(lambda r: train(r, tmp_path / "whole", 2))
    monkeypatch.setattr(exchange_mod, "CPU_BLOCK", 5)
    small = in_threads(lambda r: train(r, tmp_path / "small", 2))
    for r in REGIONS:
        assert small[r]["sync"].ex.block == 5
        for a, b in zip(whole[r]["rounds"], small[r]["rounds"], strict=True):
            assert torch.equal(a["after"], b["after"]) and torch.equal(a["momentum"], b["momentum"])
            assert torch.equal(b["after"], b["theta_outer"])


def test_outer_placement_keeps_the_state_on_the_gpu_up_to_the_threshold(tmp_path):
    """outer_device auto: on the training device up to outer_device_max_gib, above it in pinned host memory;
    outer_device cpu: always host memory. A decision on sizes only: no GPU needed to check it."""
    from sbatch_gen.train.xr.sync import GIB, outer_placement

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = xr_for("eu", tmp_path)
    assert auto.outer_device_max_gib == 16
    assert outer_placement(auto, gpu, 16 * GIB)[:2] == (gpu, False)
    dev, pinned, why = outer_placement(auto, gpu, 16 * GIB + 4)
    assert (dev, pinned) == (cpu, True) and "above outer_device_max_gib 16" in why
    assert outer_placement(xr_for("eu", tmp_path, outer_device_max_gib=0), gpu, 4)[:2] == (cpu, True)
    assert outer_placement(xr_for("eu", tmp_path, outer_device="cpu"), gpu, 4) == (
        cpu,
        True,
        "outer_device: cpu",
    )
    assert outer_placement(auto, cpu, 4) == (cpu, False, "the training device is the CPU")


@pytest.mark.parametrize("mode, per_param", [("diloco", 16), ("grad", 8)])
def test_a_leader_holds_the_outer_buffers_and_logs_where(tmp_path, mode, per_param):
    """One process is its region's only leader: it holds the flat fp32 buffers (DiLoCo: theta_outer,
    momentum, delta, average; grad: gradient, average) and logs where and how much (the multi-process
    tests check the other ranks hold none)."""
    events = []
    _, s = make("eu", tmp_path, log=events.append, sync=mode, outer_device_max_gib=0)
    assert s.leader and s.outer_bytes() == per_param * s.numel == s.state_bytes()
    (ev,) = [e for e in events if e["event"] == "xr_outer_state"]
    assert ev["bytes_per_rank"] == [per_param * s.numel] and ev["leaders"] == [0] and ev["numel"] == s.numel
    assert ev["device"] == "cpu" and ev["pinned"] is False and "above outer_device_max_gib 0" in ev["why"]


def test_gpu_blocks_bound_the_outer_scratch():
    """On a GPU the average and the Nesterov step also run over blocks (GPU_BLOCK elements), so their
    scratch is one block, not a whole fp32 copy of the model (the fifth 4 B/param buffer of old)."""
    from sbatch_gen.train.xr.exchange import Exchange
    from sbatch_gen.train.xr.kernels import CPU_BLOCK, GPU_BLOCK, block_size, blocks
    from sbatch_gen.train.xr.region import Region

    n = 3 * GPU_BLOCK + 5
    g = GPU_BLOCK
    assert list(blocks(n, "cuda")) == [(0, g), (g, 2 * g), (2 * g, 3 * g), (3 * g, n)]
    assert block_size("cuda", 10) == 10 and block_size("cpu", n) == CPU_BLOCK
    xr = xr_for("eu", "unused", shard_mb=16)
    cuda = torch.device("cuda", 0)
    assert Exchange(xr, Region(DistInfo(), cuda), None, None, n, "x", [0], cuda, cuda).block == GPU_BLOCK
