"""Benchmark: the fixed cost of a steady-state DiLoCo round at an emulated RTT, with 2, 4 and 8 regions.

Each region is a process running the trainer's cross-region code (DiLoCo, ``after_optimizer_step`` ->
``rounds.run_round``) on an S3 mailbox: nanio on 127.0.0.1 behind :mod:`bench.delayproxy` on 127.0.0.1,
which delays every chunk by RTT/2 each way and every new connection by one RTT (no root needed: no
namespace, no ``tc``). The last region arrives after every other region's claim is in the store (see
:mod:`bench.roundcost_worker`); its round time, against the payload per region, is fitted by least squares
as ``time = fixed + size / rate``: ``fixed`` is what a round costs whatever its size, in RTTs the goal of
issue 40 (<= 3 RTT at 80 ms). Beside it: the requests each region's store client sent per round, the
bytes per region, and how both grow with N.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.s3server import free_port

from .common import PY, Result, bench_env, median
from .servers import NanioServer, s3_client, wait_port

MiB = 1 << 20
NAMES = ["eu", "us", "ap", "sa", "af", "me", "ca", "au"]  # the last one of a run arrives last

SHIPPED, NO_EXPECT = "as shipped", "PUTs with Expect: 100-continue (botocore's default)"
# ns_no_expect: the variant's region counts (botocore's default put back by the harness: see the worker)
FULL = dict(ns=(2, 4, 8), ns_no_expect=(2, 8), sizes_mib=(0.25, 4, 16), rounds=3, warmup=1, rtt_ms=80.0)
# seconds, for the tests: the smallest setting
QUICK = dict(ns=(2,), ns_no_expect=(2,), sizes_mib=(0.0625, 0.25), rounds=2, warmup=1, rtt_ms=20.0)
WINDOW_KB = 1 << 20  # the proxy's per-stream window: 1 GiB, i.e. none (latency only; see the setup)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` over (x, y): (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


class Proxy:
    """bench.delayproxy on 127.0.0.1 in front of ``target_port``, a process of its own."""

    def __init__(self, target_port: int, rtt_ms: float, stats: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                PY,
                "-m",
                "bench.delayproxy",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--target",
                f"127.0.0.1:{target_port}",
                "--rtt-ms",
                str(rtt_ms),
                "--window-kb",
                str(WINDOW_KB),
                "--stats",
                str(stats),
            ],
            env=bench_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_port("127.0.0.1", self.port, 30, self.proc)

    def stop(self) -> None:
        terminate(self.proc)


def run_n(
    work: Path, srv: NanioServer, endpoint: str, n: int, cfg: dict, variant: str = SHIPPED
) -> list[dict]:
    """One run of ``n`` regions over every size: the records of every region's rounds."""
    tag = f"n{n}{'x' if variant != SHIPPED else ''}"
    regions = NAMES[:n]
    sizes = [int(m * MiB) for m in cfg["sizes_mib"]]
    procs, outs = [], []
    for reg in regions:
        out = work / f"{tag}-{reg}.json"
        cmd = [
            PY,
            "-m",
            "bench.roundcost_worker",
            "--region",
            reg,
            "--regions",
            ",".join(regions),
            "--endpoint",
            endpoint,
            "--direct",
            srv.endpoint_url,
            "--prefix",
            tag,
            "--sizes",
            ",".join(map(str, sizes)),
            "--rounds",
            str(cfg["rounds"]),
            "--warmup",
            str(cfg["warmup"]),
            "--rtt-ms",
            str(cfg["rtt_ms"]),
            "--barrier-dir",
            str(work / f"barrier-{tag}"),
            "--out",
            str(out),
            *(["--with-expect"] if variant != SHIPPED else []),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=bench_env(srv.env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
        outs.append(out)
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"roundcost worker failed ({p.returncode}) with {n} regions:\n{log[-4000:]}")
    recs = []
    for reg, o in zip(regions, outs, strict=True):
        for rec in json.loads(o.read_text()):
            recs.append({"region": reg, "n": n, "variant": variant, **rec})
    return recs


def analyse(recs: list[dict], cfg: dict, ns, variant: str = SHIPPED) -> dict:
    """Per N: the last region's round time per size (median), the fit, requests and bytes per region."""
    rtt = cfg["rtt_ms"] / 1000
    out: dict = {}
    for n in ns:
        mine = [r for r in recs if r["n"] == n and not r["warmup"] and r["variant"] == variant]
        last = [r for r in mine if r["last"]]
        others = [r for r in mine if not r["last"]]
        per_size = []
        for m in cfg["sizes_mib"]:
            size = int(m * MiB)
            ls = [r for r in last if r["size"] == size]
            os_ = [r for r in others if r["size"] == size]
            ops: Counter = Counter()
            for r in ls:
                ops.update(r["by_op"])
            per_size.append(
                {
                    "mib": m,
                    "last_s": median([r["took_s"] for r in ls]),
                    "last_all_s": [round(r["took_s"], 4) for r in ls],
                    "last_requests": median([r["requests"] for r in ls]),
                    "last_by_op": {k: v / len(ls) for k, v in sorted(ops.items())},
                    "others_requests": median([r["requests"] for r in os_]),
                    "others_s": median([r["took_s"] for r in os_]),
                    "bytes_up": median([r.get("xr_bytes_up", 0) for r in ls]),
                    "bytes_down": median([r.get("xr_bytes_down", 0) for r in ls]),
                    "phases": {
                        k: median([r.get(f"xr_{k}", 0.0) for r in ls])
                        for k in ("upload_s", "wait_s", "download_s", "reduce_s", "outer_step_s")
                    },
                    "members": len(ls[0]["members"]) if ls and ls[0].get("members") else None,
                }
            )
        # the fit of the per-size medians: one slow round in a size (this machine is shared) moves it
        # little; the fit of every round is beside it
        a, b = fit([(s["mib"], s["last_s"]) for s in per_size])
        a_all, b_all = fit([(r["size"] / MiB, r["took_s"]) for r in last])
        out[n] = {
            "fixed_s": a,
            "fixed_rtt": a / rtt,
            "s_per_mib": b,
            "MBps_moved": (n * MiB / b / 1e6) if b > 0 else None,  # the last region's up + (n-1) down
            "fixed_all_s": a_all,
            "fixed_all_rtt": a_all / rtt,
            "s_per_mib_all": b_all,
            "sizes": per_size,
        }
    return out


def run(out_dir: Path, quick: bool = False, cfg: dict | None = None) -> Result:
    cfg = dict(cfg or (QUICK if quick else FULL))
    rtt_ms = cfg["rtt_ms"]
    res = Result(
        "roundcost", f"The fixed cost of a steady-state round at {rtt_ms:g} ms RTT, 2 to 8 regions", quick
    )
    res.setup += [
        f"Regions: {', '.join(str(n) for n in cfg['ns'])}, each region one process on this machine running the "
        "trainer's cross-region code: `DiLoCo.after_optimizer_step` (sync: diloco, inner_steps 1), which runs "
        "`rounds.run_round`, on an S3 mailbox. CrossRegion defaults otherwise (strict rounds, bf16 payload, "
        "16 MiB shards, 16 threads, the trainer's poll settings); `keep_rounds` and `snapshot_every` beyond the "
        "run, so no housekeeping (deletes, snapshots) runs inside a measured round: the round's protocol only.",
        f"Store: nanio on 127.0.0.1 (data on tmpfs) behind `bench/delayproxy.py` on 127.0.0.1, {rtt_ms:g} ms RTT: "
        "every chunk is delayed RTT/2 each way and every new connection one RTT more, so each request pays one "
        "RTT. No root needed (no namespace, no `tc`): **latency only**, no rate limit and no per-stream window "
        f"(window {WINDOW_KB // 1024} MiB): the rate is what the proxy and the server move on this shared "
        "2-core machine, whose cores every region, the proxy and the server share. The window-limited WAN is "
        "`bench mailbox`'s and `bench overlap`'s (root).",
        f"Payload per region (wire bytes, bf16): {', '.join(f'{m:g}' for m in cfg['sizes_mib'])} MiB "
        f"({', '.join(f'{m * MiB // 2 / 1e6:.3g}M' for m in cfg['sizes_mib'])} parameters in 8 tensors). "
        f"Per N and size: {cfg['warmup']} warm-up round (left out: the process's first round reads more) and "
        f"{cfg['rounds']} measured rounds.",
        "Every round starts together (a file barrier); the last region then waits until every other region's "
        "claim is in the store (read directly from nanio, without the proxy: the harness, not the round) and "
        "one RTT more, then starts its round: it arrives last, with the others polling, so its round "
        "(`after_optimizer_step`'s wall time: publish, look, fetch, decode, average, outer step) is the "
        "critical path of a steady round. **round time** below is that region's, median of the measured rounds.",
        "Fit: least squares of the last region's median round time per size, `time = fixed + size / rate`, size "
        "the payload per region in MiB (the fit of every measured round beside it: one slow round on this shared "
        "machine moves that one more). `fixed` in RTTs is the goal's measure. The rate is the bytes the last region "
        "moves (its upload + the N-1 others' payloads) per second of slope.",
        "Variant **PUTs with Expect: 100-continue (botocore's default)** (regions "
        f"{', '.join(str(n) for n in cfg['ns_no_expect']) or 'none'}): botocore sends every PUT with a body with "
        "`Expect: 100-continue`, so the PUT waits one RTT for the server's `100 Continue` before it sends its "
        "body; the trainer's store turns that off, and this variant puts botocore's handler back on the regions' "
        "clients, to show side by side what that round trip costs each round.",
        "Requests: every HTTP request the region's boto3 client sent during the round (botocore's `before-send`, "
        "retries included), by operation. The last region's count is its critical path's; the others' "
        "include their polls.",
    ]
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-roundcost-", dir=shm if shm.is_dir() else None))
    recs: list[dict] = []
    try:
        srv = NanioServer(data_dir=str(work / "nanio")).start()
        proxy = None
        try:
            s3_client(srv.endpoint_url).create_bucket(Bucket="bench")
            proxy = Proxy(srv.port, rtt_ms, work / "proxy-stats.json")
            endpoint = f"http://127.0.0.1:{proxy.port}"
            for variant, ns in ((SHIPPED, cfg["ns"]), (NO_EXPECT, cfg["ns_no_expect"])):
                for n in ns:
                    print(f"roundcost: {n} regions, {variant}", flush=True)
                    got = run_n(work, srv, endpoint, n, cfg, variant)
                    recs += got
                    for r in got:
                        if r["last"] and not r["warmup"]:
                            print(
                                f"  {r['size'] / MiB:g} MiB: {r['took_s']:.3f} s, {r['requests']} requests",
                                flush=True,
                            )
        finally:
            if proxy is not None:
                proxy.stop()
            srv.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    an = analyse(recs, cfg, cfg["ns"])
    bare = analyse(recs, cfg, cfg["ns_no_expect"], NO_EXPECT) if cfg["ns_no_expect"] else {}
    res.data["analysis"] = {SHIPPED: an, NO_EXPECT: bare}
    _report(res, an, bare, cfg)
    res.data["rounds"] = recs
    return res


def _report(res: Result, an: dict, bare: dict, cfg: dict) -> None:
    rtt = cfg["rtt_ms"] / 1000
    ns = list(cfg["ns"])
    both = [(SHIPPED, n, an[n]) for n in ns] + [(NO_EXPECT, n, bare[n]) for n in cfg["ns_no_expect"]]
    res.table(
        "Fit of the last region's round time against the payload per region",
        [
            "variant",
            "regions",
            "fixed s",
            "fixed in RTT",
            "s per MiB",
            "MB/s moved by the last region",
            "fit of every round: fixed s (RTT), s per MiB",
            "round s per size",
            "requests per round (last)",
        ],
        [
            [
                v,
                n,
                a["fixed_s"],
                a["fixed_rtt"],
                a["s_per_mib"],
                a["MBps_moved"],
                f"{a['fixed_all_s']:.3f} ({a['fixed_all_rtt']:.1f}), {a['s_per_mib_all']:.4f}",
                ", ".join(f"{s['mib']:g} MiB: {s['last_s']:.3f}" for s in a["sizes"]),
                ", ".join(f"{s['last_requests']:g}" for s in a["sizes"]),
            ]
            for v, n, a in both
        ],
        "fit",
    )
    rows = []
    for v, n, a in both:
        for s in a["sizes"]:
            ph = s["phases"]
            rows.append(
                [
                    v,
                    n,
                    s["mib"],
                    s["last_s"],
                    s["last_s"] / rtt,
                    s["last_requests"],
                    ", ".join(f"{k} {v:g}" for k, v in s["last_by_op"].items()),
                    s["others_requests"],
                    s["bytes_up"] / MiB,
                    s["bytes_down"] / MiB,
                    ph["upload_s"],
                    ph["wait_s"],
                    ph["download_s"],
                    ph["reduce_s"] + ph["outer_step_s"],
                ]
            )
    res.table(
        "Per N and size: the last region's round, its requests and bytes, and its phases (medians)",
        [
            "variant",
            "regions",
            "MiB/region",
            "round s",
            "round in RTT",
            "requests (last)",
            "by operation (last)",
            "requests (others, median)",
            "MiB up",
            "MiB down",
            "upload s",
            "wait s",
            "download s",
            "reduce + outer s",
        ],
        rows,
        "per_size",
    )
    base = an[ns[0]]
    res.headline[f"fixed cost of a round, {ns[0]} regions, {cfg['rtt_ms']:g} ms RTT"] = (
        f"{base['fixed_s']:.3f} s = {base['fixed_rtt']:.1f} RTT"
    )
    for n in ns[1:]:
        res.headline[f"fixed cost, {n} regions"] = f"{an[n]['fixed_s']:.3f} s = {an[n]['fixed_rtt']:.1f} RTT"
    judged = None if res.quick else True
    res.goal(
        f"fixed cost of a steady round at {cfg['rtt_ms']:g} ms RTT <= 3 RTT (<= 0.3 s), {ns[0]} regions",
        f"{base['fixed_s']:.3f} s = {base['fixed_rtt']:.1f} RTT",
        None if judged is None else base["fixed_s"] <= 0.3,
    )
    if len(ns) > 1:
        hi = ns[-1]
        ratios = [
            (s8["mib"], s8["last_s"] / s2["last_s"])
            for s2, s8 in zip(an[ns[0]]["sizes"], an[hi]["sizes"], strict=True)
        ]
        res.goal(
            f"round time with {hi} regions <= 2x that with {ns[0]}, same payload per region",
            ", ".join(f"{m:g} MiB: {x:.2f}x" for m, x in ratios),
            None if judged is None else all(x <= 2 for _, x in ratios),
        )
        res.goal(
            f"fixed cost with {hi} regions <= 2x that with {ns[0]}",
            f"{an[hi]['fixed_s'] / base['fixed_s']:.2f}x ({an[hi]['fixed_s']:.3f} s against {base['fixed_s']:.3f} s)",
            None if judged is None else an[hi]["fixed_s"] <= 2 * base["fixed_s"],
        )
    for n in cfg["ns_no_expect"]:
        res.headline[f"fixed cost, {n} regions, PUTs with Expect: 100-continue (botocore's default)"] = (
            f"{bare[n]['fixed_s']:.3f} s = {bare[n]['fixed_rtt']:.1f} RTT"
        )
