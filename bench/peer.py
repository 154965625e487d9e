"""Benchmark: sbatch-gen against torchft on the same work and the same emulated WAN, side by side in one run.

Two replicas (regions) a and b, each a torchrun of 2 processes (one DDP group over gloo), train the same
GPT on the same shards with the same inner AdamW, schedule, H, outer Nesterov lr and momentum and the
same injected per-step sleep (standing in for a faster device's compute):

* **torchft** 0.2.0 as its documentation sets it up: its lighthouse (``torchft_lighthouse``), a
  ``Manager`` per rank with a gloo process group across the replicas, ``torchft.local_sgd.DiLoCo``
  (:mod:`bench.peer_torchft`). The replicas exchange pseudo-gradients by allreduce, each rank with the
  same rank of the other replica.
* **ours**: the real trainer (``python -m sbatch_gen.train`` under torchrun), DiLoCo over the S3 mailbox
  (nanio, the mailbox's test server) or over fs.

Variants: DiLoCo without overlap, and Streaming DiLoCo (F fragments, tau steps of delay; the same split
of the parameters and the same ``alpha`` on both sides). Ours also with its default bf16 payload and
int8; torchft's quantized allreduce needs triton and CUDA, so it is fp32 here.

The network (:class:`bench.wan.Star`): every replica in its own network namespace with its own link
(``tc tbf``) to a hub namespace; every TCP connection a replica opens gets the RTT and a per-stream
window from a transparent delay proxy, which also counts the bytes. torchft's lighthouse and our object
store both live in the hub: a replica's traffic to its peer (torchft) or to the store (ours) crosses its
own link. ``--quick``: a tiny model, no WAN (everything on this host's loopback, ours over fs).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.regions import RegionRun
from sbatch_gen.testing.s3server import free_port
from sbatch_gen.train.data import prepare
from sbatch_gen.train.trainer import ENV_STEP_SLEEP
from sbatch_gen.xr_options import CrossRegion, FsTransport, S3Transport, to_argv

from .common import PY, REPO, Result, bench_env, median
from .elastic import DATA_BYTES, HELDOUT, REGIONS, _config, heldout_loss
from .wan import Star, available_star

TIMEOUT = 900  # seconds one run may take
NPROC = 2  # processes per replica
# the DiLoCo paper's outer optimizer (Nesterov, lr 0.7, momentum 0.9), torchft's examples' too; our quality
# benchmark found streaming best there
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
ALPHA = 0.5  # streaming: fragment_alpha (ours' default) = torchft's fragment_update_alpha


@dataclass(frozen=True)
class V:
    """One run: which system, over what, which payload; F fragments and tau (streaming) or F = 1 (none)."""

    system: str  # torchft | ours
    transport: str  # gloo (torchft) | s3 | fs
    dtype: str  # fp32 (torchft) | our payload_dtype
    frags: int = 1
    tau: int = 0

    @property
    def overlap(self) -> str:
        return "streaming" if self.frags > 1 else "none"

    @property
    def label(self) -> str:
        stream = f" F={self.frags} tau={self.tau}" if self.frags > 1 else ""
        return f"{self.system} {self.transport} {self.dtype}, {self.overlap}{stream}"

    @property
    def name(self) -> str:
        return f"{self.system}-{self.transport}-{self.dtype}-f{self.frags}-t{self.tau}"


@dataclass(frozen=True)
class Sizes:
    model: dict
    batch: int
    h: int
    rounds: int
    sleep_s: float
    frags: int
    tau: int
    eval_windows: int
    links: tuple[tuple[int, float], ...]  # (Mbit/s, RTT ms) of the emulated WAN; () = loopback only
    window_kb: int

    def variants(self, wan: bool) -> list[V]:
        tr = "s3" if wan else "fs"
        out = []
        for f, t in ((1, 0), (self.frags, self.tau)):
            out += [
                V("torchft", "gloo", "fp32", f, t),
                V("ours", tr, "fp32", f, t),
                V("ours", tr, "bf16", f, t),
            ]
        if wan:
            out += [V("ours", tr, "int8", 1, 0), V("ours", tr, "int8", self.frags, self.tau)]
        return out


FULL = Sizes(
    model={"n_layers": 4, "d_model": 384, "n_heads": 6, "seq_len": 32},
    batch=2,
    h=12,
    rounds=6,
    sleep_s=0.4,
    frags=4,
    tau=1,
    eval_windows=512,
    links=((400, 80.0), (100, 80.0)),
    # 4 MiB: this kernel's tcp_wmem maximum, the most one stream keeps in flight
    window_kb=4096,
)
QUICK = Sizes(
    model={"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
    batch=1,
    h=4,
    rounds=2,
    sleep_s=0.0,
    frags=2,
    tau=1,
    eval_windows=32,
    links=(),
    window_kb=4096,
)


# ---------------------------------------------------------------------------------------------------
# one run of each side


def _torchrun(prefix: list[str], master: str, module: str, args: list[str]) -> list[str]:
    return [
        *prefix,
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={NPROC}",
        f"--master-addr={master}",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]


def _start(cmd: list[str], env: dict, log: Path, region: str, run_dir: Path) -> RegionRun:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    return RegionRun(region, run_dir, [p], [log], cmd)


def _finish(runs: list[RegionRun], what: str) -> None:
    for r in runs:
        try:
            rcs = r.wait(TIMEOUT)
        except TimeoutError:
            for o in runs:
                o.kill()
            raise
        if any(rcs):
            for o in runs:
                o.kill()
            raise RuntimeError(f"{what}: replica {r.region} exited {rcs}\n{r.tail()}")


class Net:
    """Where a run's processes live: this host's loopback (``star`` None) or the emulated WAN."""

    def __init__(self, star: Star | None, work: Path) -> None:
        self.star, self.work = star, work
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_url = ""
        self.s3: S3Transport | None = None
        self.s3_env: dict[str, str] = {}
        self._srv = None

    def prefix(self, where: str) -> list[str]:
        return self.star.exec_prefix(where) if self.star else []

    def addr(self, where: str) -> str:
        if self.star is None:
            return "127.0.0.1"
        return self.star.hub_ip if where == "hub" else self.star.region_ip(where)

    def bytes(self) -> dict[str, int]:
        """Bytes each replica's link carried so far, both ways (zeros on loopback)."""
        if self.star is None:
            return {r: 0 for r in REGIONS}
        st = self.star.stats()
        return {r: st[r]["out"] + st[r]["in"] for r in REGIONS}

    def start_lighthouse(self) -> None:
        port = free_port()
        exe = str(Path(PY).parent / "torchft_lighthouse")
        # both replicas in every quorum: strict rounds, as ours run (min_regions: all)
        cmd = [
            *self.prefix("hub"),
            exe,
            "--min_replicas",
            str(len(REGIONS)),
            "--bind",
            f"{self.addr('hub')}:{port}",
        ]
        # a quorum waits this long for a replica that heartbeats but has not joined yet
        cmd += ["--join_timeout_ms", "10000"]
        log = open(self.work / "lighthouse.log", "ab")
        self.lighthouse = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.lighthouse_url = f"http://{self.addr('hub')}:{port}"

    def start_s3(self) -> None:
        from .servers import make_server

        hub = self.star.hub_ns if self.star else None
        srv = make_server("nanio", host=self.addr("hub"), netns=hub, data_dir=str(self.work / "nanio"))
        srv.start()
        self._srv = srv
        endpoint = srv.endpoint_url
        subprocess.run(
            [*self.prefix(REGIONS[0]), PY, "-m", "bench.mailbox_worker", "mkbucket", "--endpoint", endpoint]
            + ["--bucket", "bench", "--out", "-"],
            env=bench_env(srv.env()),
            check=True,
            capture_output=True,
        )
        self.s3 = S3Transport(
            bucket="bench",
            prefix="peer",
            endpoint_url=endpoint,
            addressing_style="path",
            region_name="us-east-1",
        )
        self.s3_env = srv.env()

    def stop(self) -> None:
        p, self.lighthouse = self.lighthouse, None
        terminate(p)
        if self._srv is not None:
            self._srv.stop()
            self._srv = None


def _run_torchft(net: Net, root: Path, cfg: Path, sz: Sizes, v: V) -> list[RegionRun]:
    runs = []
    for r in REGIONS:
        args = ["--config", str(cfg), "--replica", r, "--out", str(root / r), "--inner-steps", str(sz.h)]
        args += [
            "--fragments",
            str(v.frags),
            "--delay",
            str(v.tau),
            "--alpha",
            str(ALPHA if v.frags > 1 else 0.0),
        ]
        args += [
            "--outer-lr",
            repr(OUTER_LR),
            "--outer-momentum",
            repr(OUTER_MOMENTUM),
            "--hostname",
            net.addr(r),
        ]
        env = {"TORCHFT_LIGHTHOUSE": net.lighthouse_url, ENV_STEP_SLEEP: repr(sz.sleep_s)}
        if net.star is not None:
            env["GLOO_SOCKET_IFNAME"] = net.star.region_dev(r)
        cmd = _torchrun(net.prefix(r), net.addr(r), "bench.peer_torchft", args)
        runs.append(_start(cmd, bench_env(env), root / "logs" / f"{r}.log", r, root / r))
    return runs


def _run_ours(net: Net, root: Path, cfg: Path, data: Path, sz: Sizes, v: V) -> list[RegionRun]:
    transport = net.s3 if v.transport == "s3" else FsTransport(root=str(root / "mailbox"))
    fields: dict = {
        "enabled": True,
        "run_id": v.name,
        "regions": REGIONS,
        "sync": "diloco",
        "transport": transport,
        "timeout_s": 600,
        "inner_steps": sz.h,
        "outer_lr": OUTER_LR,
        "outer_momentum": OUTER_MOMENTUM,
        "payload_dtype": v.dtype,
        "overlap": v.overlap,
        "keep_rounds": 1,
        **(
            {"fragments": v.frags, "fragment_delay_steps": v.tau, "fragment_alpha": ALPHA}
            if v.frags > 1
            else {}
        ),
    }
    runs = []
    for r in REGIONS:
        xr = CrossRegion(region=r, **fields)
        args = [
            "--config",
            str(cfg),
            "--run-dir",
            str(root / r),
            "--resume",
            "none",
            "--data-path",
            str(data),
        ]
        cmd = _torchrun(net.prefix(r), "127.0.0.1", "sbatch_gen.train", [*args, *to_argv(xr)])
        env = {**net.s3_env, ENV_STEP_SLEEP: repr(sz.sleep_s)}
        runs.append(_start(cmd, bench_env(env), root / "logs" / f"{r}.log", r, root / r))
    return runs


# ---------------------------------------------------------------------------------------------------
# what a run measured


def _jsonl(f: Path) -> list[dict]:
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def _figures_torchft(ranks: list[list[dict]], sz: Sizes, what: str) -> dict:
    """Rank 0's times; the loss as ours logs it (the mean over the replica's ranks)."""
    steps = [[r for r in recs if "step" in r] for recs in ranks]
    for s in steps:
        if [r["step"] for r in s] != list(range(1, sz.h * sz.rounds + 1)):
            raise RuntimeError(f"{what}: steps {[r['step'] for r in s][:8]}... of {len(s)}")
    first = steps[0]
    return {
        "wall_s": sum(r["step_time_s"] for r in first),
        # the sync runs in DiLoCo's optimizer-step hook: the seconds from AdamW's end to the step's end
        "exposed_s": sum(r["sync_s"] for r in first),
        "syncs": first[-1]["manager_step"],  # torchft counts the committed fragment syncs
        "round_s": None,
        "losses": [statistics.mean(r["loss"] for r in at) for at in zip(*steps, strict=True)],
    }


def _figures_ours(recs: list[dict], sz: Sizes, v: V, what: str) -> dict:
    steps = [r for r in recs if "event" not in r and "step_time_s" in r]
    if [r["step"] for r in steps] != list(range(1, sz.h * sz.rounds + 1)):
        raise RuntimeError(f"{what}: steps {[r['step'] for r in steps][:8]}... of {len(steps)}")
    final = [r for r in recs if r.get("event") == "xr_final_round"]
    rounds = [r for r in steps if "xr_round" in r] + final
    if len(rounds) != sz.rounds * v.frags:
        raise RuntimeError(f"{what}: {len(rounds)} rounds")
    final_s = sum(r["xr_exposed_s"] for r in final)
    return {
        "wall_s": sum(r["step_time_s"] for r in steps) + final_s,
        "exposed_s": sum(r["xr_exposed_s"] for r in steps + final if "xr_exposed_s" in r),
        "syncs": len(rounds),
        "round_s": median([r["xr_total_s"] for r in rounds]),
        "losses": [r["loss"] for r in steps if "loss" in r],
    }


def _distance(x: Path, y: Path) -> tuple[bool, float]:
    """Whether the two exported models hold the same tensors bitwise, and the largest difference."""
    import torch
    from safetensors.torch import load_file

    px, py = load_file(str(x)), load_file(str(y))
    if px.keys() != py.keys():
        raise RuntimeError(f"{x} and {y} hold different tensors")
    same = all(torch.equal(px[k], py[k]) for k in px)
    return same, max(float((px[k].float() - py[k].float()).abs().max()) for k in px)


def _one(net: Net, work: Path, cfg: Path, data: Path, sz: Sizes, v: V, link: str) -> dict:
    root = work / f"{link}-{v.name}"
    before = net.bytes()
    t0 = time.monotonic()
    if v.system == "torchft":
        net.start_lighthouse()
        try:
            runs = _run_torchft(net, root, cfg, sz, v)
            _finish(runs, f"{link} {v.label}")
        finally:
            p, net.lighthouse = net.lighthouse, None
            terminate(p)
    else:
        _finish(_run_ours(net, root, cfg, data, sz, v), f"{link} {v.label}")
    took = time.monotonic() - t0
    after = net.bytes()
    per = {}
    for r in REGIONS:
        what = f"{link} {v.label} {r}"
        if v.system == "torchft":
            per[r] = _figures_torchft([_jsonl(root / r / f"rank{i}.jsonl") for i in range(NPROC)], sz, what)
        else:
            per[r] = _figures_ours(_jsonl(root / r / "metrics.jsonl"), sz, v, what)
        per[r]["wire_bytes"] = after[r] - before[r]
    models = [root / r / "model.safetensors" for r in REGIONS]
    same, dist = _distance(*models)
    loss = {
        r: heldout_loss(m, {**sz.model, "dropout": 0.0}, data / f"{HELDOUT}.bin", sz.eval_windows)
        for r, m in zip(REGIONS, models, strict=True)
    }
    shutil.rmtree(root, ignore_errors=True)
    out = {
        "link": link,
        "variant": v,
        "label": v.label,
        "took_s": took,
        "regions": per,
        "same": same,
        "max_diff": dist,
        "heldout": loss,
        "wall_s": max(per[r]["wall_s"] for r in REGIONS),
        "share": max(per[r]["exposed_s"] / per[r]["wall_s"] for r in REGIONS),
        "exposed_per_round_s": max(per[r]["exposed_s"] for r in REGIONS) / (sz.rounds * v.frags),
        # a connection is counted once, by the proxy of the replica that opened it (torchft's peers open
        # connections to each other): the mean over the replicas is a replica's share
        "wire_per_round": statistics.mean(per[r]["wire_bytes"] for r in REGIONS) / (sz.rounds * v.frags),
    }
    print(
        f"  peer {link}: {v.label}: wall {out['wall_s']:.1f} s, exposed {out['share']:.1%}, "
        f"held-out {statistics.mean(loss.values()):.4f}, same {same} ({took:.0f} s)",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------------------------


def run(out_dir: Path, quick: bool = False) -> Result:
    sz = QUICK if quick else FULL
    res = Result(
        "peer", "Side by side with torchft: the same model, data and WAN, measured in one run", quick
    )
    why = available_star() if sz.links else "--quick"
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sbgen-bench-peer-", dir=shm if shm.is_dir() else None))
    rows: list[dict] = []
    try:
        data = work / "data"
        prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
        cfg = _config(
            work / "peer.yaml",
            steps=sz.h * sz.rounds,
            model=sz.model,
            batch=sz.batch,
            data_dir=data,
            ckpt_every=1_000_000,
            warmup=1,
        )
        # loopback: the systems' own costs, no network; then each emulated link
        net = Net(None, work)
        for v in sz.variants(wan=False):
            rows.append(_one(net, work, cfg, data, sz, v, "loopback"))
        if why is None:
            for rate, rtt in sz.links:
                with Star(rate_mbit=rate, rtt_ms=rtt, window_kb=sz.window_kb) as star:
                    net = Net(star, work)
                    net.start_s3()
                    try:
                        for v in sz.variants(wan=True):
                            rows.append(_one(net, work, cfg, data, sz, v, f"{rate} Mbit/s, {rtt:g} ms"))
                    finally:
                        net.stop()
                    res.setup.append(f"**{rate} Mbit/s, {rtt:g} ms**: {star.describe()}")
        elif sz.links:
            res.notes.append(f"No emulated WAN ({why}): loopback only, the goals not judged.")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, sz, rows, why)
    _plot(res, out_dir, rows)
    return res


def _twin(rows: list[dict], r: dict) -> dict | None:
    """The torchft run ours' run ``r`` compares with: the same link, overlap, F and tau."""
    v = r["variant"]
    if v.system == "torchft":
        return None
    for o in rows:
        w = o["variant"]
        if o["link"] == r["link"] and w.system == "torchft" and (w.frags, w.tau) == (v.frags, v.tau):
            return o
    return None


def _loss_gap(r: dict, twin: dict) -> float:
    """The largest difference between the two runs' training losses, step by step, over both replicas."""
    return max(
        abs(x - y)
        for reg in REGIONS
        for x, y in zip(r["regions"][reg]["losses"], twin["regions"][reg]["losses"], strict=True)
    )


def _mean(d: dict) -> float:
    return statistics.mean(d.values())


def _report(res: Result, sz: Sizes, rows: list[dict], why: str | None) -> None:
    m = sz.model
    res.setup[:0] = [
        f"2 replicas (a, b), each a torchrun of {NPROC} processes (a DDP group over gloo, CPU, one thread each) on "
        f"this machine's {__import__('os').cpu_count()} cores; a {m['n_layers']}-layer width-{m['d_model']} GPT, "
        f"batch {sz.batch} x {m['seq_len']} tokens per process, {sz.h * sz.rounds} steps, DiLoCo H={sz.h} "
        f"({sz.rounds} rounds), outer Nesterov lr {OUTER_LR:g} momentum {OUTER_MOMENTUM:g}, inner AdamW and the "
        f"trainer's schedule; a per-step sleep of {sz.sleep_s:g} s (`{ENV_STEP_SLEEP}`) stands in for a faster "
        "device's compute, on both sides. Both sides take the model, data, optimizer and schedule from our "
        "trainer's code (bench/peer_torchft.py), so each replica sees the same tokens in the same order.",
        f"Streaming: F={sz.frags} fragments, tau={sz.tau}, alpha {ALPHA:g} on both sides (torchft: "
        "`fragment_sync_delay`, `fragment_update_alpha`; the fragments hold the parameters our split assigns). "
        "torchft sends a fragment tau steps before its sync point and merges at it; ours starts a round at the "
        "point and merges tau steps later (the last round after the last step, in the run's wall time).",
        "torchft: lighthouse `torchft_lighthouse --min_replicas 2` in the hub (strict rounds, as ours), a `Manager` per rank "
        "(synchronous quorum, as its DiLoCo requires), `ProcessGroupGloo` across the replicas: each rank "
        "allreduces the whole fp32 pseudo-gradient with the same rank of the other replica. Its quantized "
        "allreduce (`should_quantize`) needs triton and CUDA: not available on this machine, fp32 only.",
        "Ours: the real trainer (`python -m sbatch_gen.train`) under torchrun, strict DiLoCo rounds through the "
        "S3 mailbox (nanio in the hub) on the WAN, through an fs mailbox on tmpfs on loopback; payload fp32 "
        "(torchft's bytes), bf16 (our default) and int8.",
        "Wall: the sum of the steps' times (rank 0; ours: plus the final round's join after the last step). "
        "Exposed: the time the sync held training up. Ours: the trainer's own `xr_exposed_s`. torchft syncs "
        "inside the optimizer step (DiLoCo's step hook): per step the seconds from AdamW's own end (a hook "
        "registered before DiLoCo's) to the step's end. "
        "Per round: exposed / the number of rounds (F per H with streaming). Wire: the bytes the replicas' "
        "links carried both ways (the transparent proxies' count: payload, protocol and control traffic; a "
        "connection is counted by the side that opened it), per replica and round. Held-out: mean next-byte loss of each replica's final model on the held-out shard "
        f"({sz.eval_windows} windows). a == b: the two final models bitwise, else the largest difference.",
    ]
    if why is not None and not sz.links:
        res.setup.append("--quick: loopback only (no WAN), ours over fs.")
    table = []
    for r in rows:
        per = r["regions"]
        twin = _twin(rows, r)
        rs = [per[x]["round_s"] for x in REGIONS if per[x]["round_s"] is not None]
        table.append(
            [
                r["link"],
                r["variant"].system,
                r["variant"].transport,
                r["variant"].dtype,
                r["variant"].overlap
                + (f" F={r['variant'].frags} tau={r['variant'].tau}" if r["variant"].frags > 1 else ""),
                r["wall_s"],
                f"{r['share']:.1%}",
                r["exposed_per_round_s"],
                max(rs) if rs else "-",
                r["wire_per_round"] / 1e6,
                f"{_mean(r['heldout']):.4f}",
                "identical" if r["same"] else f"{r['max_diff']:.3g}",
                f"{_loss_gap(r, twin):.2g}" if twin else "-",
                r["took_s"],
            ]
        )
    res.table(
        "Each run: wall time, exposed sync share, per round, bytes on the wire, held-out loss, final models",
        [
            "link",
            "system",
            "transport",
            "payload",
            "overlap",
            "wall s",
            "exposed / wall",
            "exposed per round s",
            "ours' round s (xr_total_s)",
            "wire MB per round per replica",
            "held-out loss",
            "a == b",
            "training loss vs torchft's (largest gap)",
            "end to end s",
        ],
        table,
        "runs",
    )
    # goals: ours (its default payload, bf16) against torchft, per link and overlap mode
    for link in dict.fromkeys(r["link"] for r in rows):
        if link == "loopback" and sz.links and why is None:
            continue
        for ov in ("none", "streaming"):
            ft = [
                r
                for r in rows
                if r["link"] == link and r["variant"].system == "torchft" and r["variant"].overlap == ov
            ]
            us = [
                r
                for r in rows
                if r["link"] == link
                and r["variant"].system == "ours"
                and r["variant"].dtype == "bf16"
                and r["variant"].overlap == ov
            ]
            if not ft or not us:
                continue
            f, u = ft[0], us[0]
            judge = None if res.quick else True
            lf, lu = _mean(f["heldout"]), _mean(u["heldout"])
            res.goal(
                f"{link}, {ov}: wall time, ours <= torchft",
                f"ours {u['wall_s']:.1f} s, torchft {f['wall_s']:.1f} s ({u['wall_s'] / f['wall_s']:.2f}x)",
                judge and u["wall_s"] <= f["wall_s"],
            )
            res.goal(
                f"{link}, {ov}: exposed sync share, ours <= torchft",
                f"ours {u['share']:.1%}, torchft {f['share']:.1%}",
                judge and u["share"] <= f["share"],
            )
            res.goal(
                f"{link}, {ov}: held-out loss, ours <= torchft + 1%",
                f"ours {lu:.4f}, torchft {lf:.4f} ({(lu / lf - 1) * 100:+.2f}%)",
                judge and lu <= lf * 1.01,
            )
            res.headline[f"{link}, {ov}: wall ours / torchft"] = f"{u['wall_s'] / f['wall_s']:.2f}x"
    res.goal(
        "faults (one replica killed, both killed, the coordinator lost): the same schedule on both sides",
        "not measured yet",
        None,
    )


def _plot(res: Result, out_dir: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        rs = [r for r in rows if r["link"] == link]
        labels = [f"{r['variant'].system} {r['variant'].dtype}\n{r['variant'].overlap}" for r in rs]
        colors = ["tab:red" if r["variant"].system == "torchft" else "tab:blue" for r in rs]
        ax.bar(range(len(rs)), [r["share"] * 100 for r in rs], color=colors)
        ax.set_xticks(range(len(rs)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("exposed sync, % of wall time")
        ax.set_title(link, fontsize=9)
    fig.suptitle("torchft (red) and sbatch-gen (blue): exposed sync share", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "peer.png", dpi=110)
    plt.close(fig)
    res.plots.append(("peer.png", "Exposed sync share per run, per link: torchft red, ours blue."))
