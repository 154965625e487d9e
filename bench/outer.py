"""Benchmark 2: the outer step (weighted average of the regions' deltas + Nesterov) vs memory bandwidth.

Runs the trainer's own code: :class:`sbatch_gen.train.xr.sync.OuterSync` of region ``a`` in a 2-region
DiLoCo run over an fs mailbox in /dev/shm, region ``b``'s bf16 deltas published beforehand, so a round's
``xr_reduce_s`` (decode + weighted average) and ``xr_outer_step_s`` (Nesterov + writing theta into the
model) are pure CPU work. Beside it, in the same process: a large ``copy_``'s bandwidth, and an in-place
reference of the same math (checked to give the same theta).

Two ways to count bytes:
* minimal: what a fused kernel must move: read both bf16 payloads, write avg; read theta, m, avg, write
  theta, m and the model parameters = (2R + 4 + 20 + 4) * N bytes for R regions.
* as executed: the sum over the torch ops the code runs of (bytes read + bytes written).
Efficiency = (bytes / copy bandwidth) / measured time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .common import Result, median, mem_available

R = 2  # regions


def byte_counter():
    """A TorchDispatchMode that sums, over the aten ops run while ``on``, the bytes each op reads and
    writes (views move nothing; ``copy_`` reads only its source; ``out=`` is written, not read)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def tensors(x) -> list:
        return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.on, self.bytes, self.ops = False, 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.on:
                name = func.overloadpacket.__name__
                ins = tensors(args) + tensors({k: v for k, v in kwargs.items() if k != "out"})
                outs = tensors(out)
                inplace = name.endswith("_") or "out" in kwargs
                ptrs = {t.untyped_storage().data_ptr() for t in ins}
                if not inplace and outs and all(t.untyped_storage().data_ptr() in ptrs for t in outs):
                    return out  # a view
                if name == "copy_":
                    ins = ins[1:2]
                b = sum(map(nbytes, ins)) + sum(map(nbytes, outs))
                self.bytes += b
                self.ops[name] = self.ops.get(name, 0) + b
            return out

    return Counter()


def _ops_bytes_ref(n: int) -> int:
    # decode a (2+4), mul_ (4+4), decode b (2+4), add_ (8+4), m.mul_ (4+4), m.add_ (8+4), theta.sub_ x2 (8+4)x2,
    # scatter (4+4)
    return (6 + 8 + 6 + 12 + 8 + 12 + 24 + 8) * n


def _minimal_bytes(n: int) -> int:
    return (2 * R + 4 + 20 + 4) * n


def run(out_dir: Path, quick: bool = False) -> Result:
    import torch
    from torch import nn

    from bench.scripted import publish
    from sbatch_gen.train.dist import DistInfo
    from sbatch_gen.train.xr import kernels as sync_mod
    from sbatch_gen.train.xr.flat import layout_fingerprint
    from sbatch_gen.train.xr.modes import create
    from sbatch_gen.train.xr.protocol import Mailbox, round_tag
    from sbatch_gen.train.xr.store import FsStore
    from sbatch_gen.xr_options import CrossRegion, FsTransport

    res = Result("outer", "Outer step vs memory bandwidth (CPU)", quick)
    n = 1 << 18 if quick else (64 << 20 if mem_available() > 10 * 2**30 else 32 << 20)
    rounds = 2 if quick else 4
    lr, mu = 0.7, 0.9
    threads = torch.get_num_threads()
    res.setup += [
        f"{n / 1e6:.1f}M fp32 parameters ({n * 4 / 2**20:.0f} MiB per buffer), 2 regions, bf16 payloads, "
        f"outer lr {lr}, momentum {mu} (Nesterov); torch {torch.__version__}, {threads} intra-op threads.",
        "xr: `OuterSync.after_optimizer_step` of region a (the trainer's code); its `xr_reduce_s` (decode + "
        "weighted average) + `xr_outer_step_s` (Nesterov + theta into the model). Region b's payloads were "
        "published beforehand to an fs mailbox in /dev/shm, so no waiting is involved.",
        "`outer_nesterov_` (the xr module's in-place Nesterov step, blocked on the CPU) alone on flat fp32 "
        "buffers, median of 5.",
        "reference: the same math over whole buffers, in place into preallocated buffers (`copy_` to decode, `mul_`, `add_(alpha=)`, "
        "`sub_`), no temporaries; "
        "checked to produce the same theta as xr (max abs difference reported).",
        "bandwidth: `dst.copy_(src)` of one buffer, counted as read + write bytes; median of 5.",
    ]
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    tmp = tempfile.TemporaryDirectory(prefix="sbgen-bench-outer-", dir=shm)
    try:
        src, dst = torch.randn(n), torch.empty(n)
        dst.copy_(src)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t0)
        bw = 2 * 4 * n / median(ts)
        del src, dst

        k = 8
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        model = nn.Module()
        model.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in sizes])
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.params:
                p.copy_(torch.randn(p.shape, generator=g))
        xr = CrossRegion(
            enabled=True,
            run_id="outer",
            region="a",
            regions=["a", "b"],
            sync="diloco",
            inner_steps=1,
            outer_lr=lr,
            outer_momentum=mu,
            transport=FsTransport(root=tmp.name),
            keep_rounds=100,
            threads=4,
        )
        sync = create(xr, model, torch.device("cpu"), DistInfo(), log=lambda d: None)
        theta0 = torch.cat([p.detach().reshape(-1) for p in model.params])
        sync.load_state_dict(
            {"round": 0, "aligned": 1, "tokens": 0, "theta_outer": theta0, "momentum": torch.zeros(n)}
        )
        peer = Mailbox(FsStore(tmp.name), "outer", "b", ["a", "b"], threads=4)
        layout = layout_fingerprint(model)
        payloads_b = []
        for r in range(1, rounds + 2):  # one more for the byte-counting round
            d = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
            payloads_b.append(d)
            publish(
                peer,
                round_tag(r),
                memoryview(d.view(torch.uint8).numpy()),
                kind="delta",
                dtype="bf16",
                layout=layout,
                step=r,
                tokens=1000,
                shard_mb=xr.shard_mb,
            )
        peer.close()

        # reference state, advanced alongside xr
        ref_theta, ref_m, ref_avg, ref_tmp = theta0.clone(), torch.zeros(n), torch.empty(n), torch.empty(n)
        offsets = [0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()]
        counter = byte_counter()
        orig_dl, orig_clean = sync.ex.download_and_average, sync._cleanup

        def dl_on(*a, **kw):  # count from the averaging ...
            counter.on = True
            return orig_dl(*a, **kw)

        def clean_off(*a, **kw):  # ... through the outer step and theta -> model, not the cleanup
            counter.on = False
            return orig_clean(*a, **kw)

        xr_t, ref_t, maxdiff, xb = [], [], 0.0, 0
        for r in range(1, rounds + 2):  # the last round only counts bytes (the counter slows it down)
            with torch.no_grad():
                for p in model.params:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-2)  # "inner steps"
                local = torch.cat([p.detach().reshape(-1) for p in model.params])
            delta_a = (sync.theta_outer - local).to(torch.bfloat16)
            if r == rounds + 1:
                sync.ex.download_and_average, sync._cleanup = dl_on, clean_off
                with counter:
                    sync.after_optimizer_step(r, 1000)
                xb = counter.bytes
                break
            t = sync.after_optimizer_step(r, 1000)
            xr_t.append(t["xr_reduce_s"] + t["xr_outer_step_s"])
            # the reference: same inputs, in place
            delta_b = payloads_b[r - 1]
            t0 = time.perf_counter()
            ref_avg.copy_(delta_a).mul_(0.5)  # same-dtype ops: mixed bf16/fp32 kernels are far slower
            ref_tmp.copy_(delta_b)
            ref_avg.add_(ref_tmp, alpha=0.5)
            ref_m.mul_(mu).add_(ref_avg)
            ref_theta.sub_(ref_avg, alpha=lr).sub_(ref_m, alpha=lr * mu)
            for p, lo in zip(model.params, offsets, strict=True):
                p.data.copy_(ref_theta[lo : lo + p.numel()])
            ref_t.append(time.perf_counter() - t0)
            maxdiff = max(maxdiff, float((ref_theta - sync.theta_outer).abs().max()))
            # continue from xr's state so both see the same inputs next round
            ref_theta.copy_(sync.theta_outer)
            ref_m.copy_(sync.momentum)
        sync.close()
        del model, sync, ref_theta, ref_m, ref_avg, ref_tmp, local, delta_a, payloads_b

        # the xr code's outer-step function alone, on flat buffers (when the xr module has one)
        nest = getattr(sync_mod, "outer_nesterov_", None)
        nest_row = None
        if nest is not None:
            th, m, gg, scratch = torch.randn(n), torch.zeros(n), torch.randn(n) * 1e-2, torch.empty(n)
            nest(th, m, gg, lr, mu, scratch)
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                nest(th, m, gg, lr, mu, scratch)
                ts.append(time.perf_counter() - t0)
            with counter:
                counter.on, counter.bytes, counter.ops = True, 0, {}
                nest(th, m, gg, lr, mu, scratch)
            nest_row = (median(ts), counter.bytes)
            del th, m, gg, scratch
    finally:
        tmp.cleanup()
    sync_block = getattr(sync_mod, "CPU_BLOCK", n)
    t_xr, t_ref = median(xr_t[1:] or xr_t), median(ref_t[1:] or ref_t)
    mb, rb = _minimal_bytes(n), _ops_bytes_ref(n)
    rows = []
    for name, t, ops, mini in (
        ("xr round: average + Nesterov + theta into the model", t_xr, xb, mb),
        ("in-place reference, same math", t_ref, rb, mb),
    ):
        rows.append(
            [name, t, mini / n, ops / n, f"{mini / bw / t:.0%}", f"{ops / bw / t:.0%}", ops / t / 1e9]
        )
    if nest_row is not None:
        nmin = 20 * n  # read theta, m, g; write theta, m
        rows.append(
            [
                "xr `outer_nesterov_` alone (flat buffers)",
                nest_row[0],
                nmin / n,
                nest_row[1] / n,
                f"{nmin / bw / nest_row[0]:.0%}",
                f"{nest_row[1] / bw / nest_row[0]:.0%}",
                nest_row[1] / nest_row[0] / 1e9,
            ]
        )
    res.table(
        "Outer step time vs the bandwidth limit",
        [
            "what",
            "time s",
            "minimal bytes/param",
            "bytes/param as executed",
            "of limit (minimal bytes)",
            "of limit (bytes as executed)",
            "achieved GB/s",
        ],
        rows,
        "outer",
    )
    res.table(
        "Bandwidth",
        ["measure", "value"],
        [
            ["large copy_ bandwidth (read+write) GB/s", bw / 1e9],
            ["the same copy counting the write-allocate read too (3 streams) GB/s", 1.5 * bw / 1e9],
            ["time limit at minimal bytes (round), s", mb / bw],
            ["max abs difference, theta (xr) vs theta (reference)", maxdiff],
        ],
        "bandwidth",
    )
    frac = mb / bw / t_xr
    res.goal(
        "outer step (average + Nesterov) >= 50% of the memory-bandwidth limit, CPU, minimal bytes",
        f"{frac:.0%}",
        None if quick else frac >= 0.5,
    )
    res.headline["outer step vs bandwidth limit (minimal bytes)"] = f"{frac:.0%}"
    res.headline["outer step vs bandwidth limit (bytes as executed)"] = f"{xb / bw / t_xr:.0%}"
    if nest_row is not None:
        res.headline["`outer_nesterov_` alone vs limit (minimal bytes)"] = f"{20 * n / bw / nest_row[0]:.0%}"
    top = sorted(counter.ops.items(), key=lambda kv: -kv[1])
    res.notes += [
        f"Bytes as executed are counted, not assumed: a TorchDispatchMode sums every aten op's reads and writes "
        f"during one extra round (views move nothing). The round ran {xb / n:.0f} bytes/parameter where one fused "
        f"pass needs {mb // n} (read 2 bf16 payloads, theta, m; write theta, m, the model).",
        "The xr code runs one eager op per elementwise step (decode, multiply, add; m*mu, +g, look-ahead, lr*, "
        "theta-=, copy into the model), but on the CPU over blocks of `CPU_BLOCK` elements "
        f"({sync_block * 4 / 2**20:.0f} MiB of fp32): all the passes over one block hit the caches, so main "
        "memory sees about what a fused kernel moves. The bytes as executed count that cache traffic too, hence "
        "fractions above 100% there. Blocking leaves every element's sequence of ops unchanged, so the bits are "
        "those of whole-buffer ops (tested); the reference runs whole-buffer ops, one memory pass each.",
        "The limit follows the issue's definition: bytes / a large copy's (read + write) bandwidth. A copy into "
        "another buffer also reads each destination line before writing it (write-allocate), which in-place "
        "ops do not, so this copy figure understates the memory system by up to 1.5x and per-op fractions "
        f"can exceed 100%. Against the 3-stream figure the headline fraction is {frac / 1.5:.0%}.",
        f"Reference and xr agree to {maxdiff:.2g} (the reference folds lr*mu into one multiply: fp32 rounding).",
    ]
    if top and nest_row is not None:
        res.notes.append(
            "Bytes by op in `outer_nesterov_`: " + ", ".join(f"{k} {v / n:.0f} B/param" for k, v in top)
        )
    return res
