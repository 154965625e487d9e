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
of the parameters and the same ``alpha`` on both sides). Ours with an fp32 payload (torchft's) and its
default bf16; torchft's quantized allreduce needs triton and CUDA, so it is fp32 here (and our int8, with
nothing to set beside it, is left to ``bench overlap`` and ``bench payload``).

The network (:class:`bench.wan.Star`): every replica in its own network namespace with its own link
(``tc tbf``) to a hub namespace; every TCP connection a replica opens gets the RTT and a per-stream
window from a transparent delay proxy, which also counts the bytes. torchft's lighthouse and our object
store both live in the hub: a replica's traffic to its peer (torchft) or to the store (ours) crosses its
own link. Faults, the same schedule on both sides (:data:`FAULTS`): one replica killed and restarted, both,
and the coordinator lost (torchft's lighthouse, our store). ``--quick``: a tiny model, no WAN (everything on
this host's loopback, ours over fs), and the one-replica fault only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sbatch_gen.testing.procs import terminate
from sbatch_gen.testing.regions import RegionRun
from sbatch_gen.testing.s3server import free_port
from sbatch_gen.train.data import prepare
from sbatch_gen.train.loop import ENV_STEP_SLEEP
from sbatch_gen.xr_options import CrossRegion, FsTransport, S3Transport, to_argv

from .common import PY, REPO, Result, bench_env, median
from .elastic import DATA_BYTES, HELDOUT, REGIONS, _config, _finish, _Watch, heldout_loss
from .wan import Star, available_star

TIMEOUT = 900  # seconds one run may take
SYSTEMS = ("torchft", "ours")
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
    payloads: tuple[str, ...]  # ours: fp32 (torchft's bytes), bf16 (our default)
    links: tuple[tuple[int, float], ...]  # (Mbit/s, RTT ms) of the emulated WAN; () = loopback only
    window_kb: int
    faults: tuple[str, ...]  # one | both | coordinator (on the first link, else on loopback)
    fault_rounds: int  # a fault run's length, in rounds of H
    fault_sleep_s: float  # its per-step sleep
    fault_step: int  # the fault comes when replica a has logged this step
    away_s: float  # a killed replica is started again this long after the kill
    outage_s: float  # the coordinator is down this long

    def variants(self, wan: bool) -> list[V]:
        tr = "s3" if wan else "fs"
        out = []
        for f, t in ((1, 0), (self.frags, self.tau)):
            out += [V("torchft", "gloo", "fp32", f, t), *(V("ours", tr, d, f, t) for d in self.payloads)]
        return out


FULL = Sizes(
    model={"n_layers": 4, "d_model": 384, "n_heads": 6, "seq_len": 32},
    batch=2,
    h=12,
    rounds=6,
    sleep_s=0.4,
    frags=4,
    tau=2,  # the most F=4 allows at H=12 (a fragment every 3 steps): the most room to hide a round
    eval_windows=512,
    payloads=("fp32", "bf16"),
    links=((400, 80.0), (100, 80.0)),
    # 4 MiB: this kernel's tcp_wmem maximum, the most one stream keeps in flight
    window_kb=4096,
    faults=("one", "both", "coordinator"),
    fault_rounds=12,
    fault_sleep_s=0.4,
    fault_step=30,  # mid-round (H=12): the round in flight is lost with the replica
    away_s=15.0,
    outage_s=30.0,
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
    payloads=("fp32",),
    links=(),
    window_kb=4096,
    faults=("one",),
    fault_rounds=10,
    fault_sleep_s=0.2,
    fault_step=6,
    away_s=1.0,
    outage_s=2.0,
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


class Net:
    """Where a run's processes live: this host's loopback (``star`` None) or the emulated WAN, and the two
    coordinators: torchft's lighthouse and our object store, both in the hub."""

    def __init__(self, star: Star | None, work: Path) -> None:
        self.star, self.work = star, work
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_url = ""
        self._lighthouse_args: list[str] = []
        self.stores: dict = {}  # kind -> S3 server

    def prefix(self, where: str) -> list[str]:
        if self.star is None:
            return []
        return self.star.exec_prefix("hub") if where == "hub" else self.star.host_prefix(where)

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

    def start_lighthouse(self, min_replicas: int | None = None) -> None:
        """torchft's lighthouse in the hub; again on the same address when ``min_replicas`` is None.
        ``min_replicas`` 2: both replicas in every quorum (strict rounds, as ours without faults); 1: a
        replica goes on alone (elastic, as ours with ``min_regions: 1``)."""
        if min_replicas is not None:
            port = free_port()
            exe = str(Path(PY).parent / "torchft_lighthouse")
            bind = f"{self.addr('hub')}:{port}"
            # join_timeout: a quorum waits this long for a replica that heartbeats but has not joined yet
            self._lighthouse_args = [exe, "--min_replicas", str(min_replicas), "--bind", bind]
            self._lighthouse_args += ["--join_timeout_ms", "10000"]
            self.lighthouse_url = f"http://{bind}"
        log = open(self.work / "lighthouse.log", "ab")
        self.lighthouse = subprocess.Popen(
            [*self.prefix("hub"), *self._lighthouse_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def stop_lighthouse(self, kill: bool = False) -> None:
        p, self.lighthouse = self.lighthouse, None
        if p is not None and kill and p.poll() is None:
            p.kill()
            p.wait()
        terminate(p)

    def start_s3(self, kind: str) -> None:
        """An S3 store of ``kind`` (:func:`bench.servers.make_server`) in the hub with the bucket ``bench``:
        nanio for the strict runs (files on disk, fast); moto for the elastic ones (ours' ``min_regions``
        below all needs conditional writes, which nanio ignores)."""
        from .servers import make_server

        hub = self.star.hub_ns if self.star else None
        data = self.work / kind
        shutil.rmtree(data, ignore_errors=True)  # a fresh store for every link
        srv = make_server(kind, host=self.addr("hub"), netns=hub, data_dir=str(data))
        srv.start()
        endpoint = srv.endpoint_url
        self.stores[kind] = srv
        subprocess.run(
            [*self.prefix(REGIONS[0]), PY, "-m", "bench.mailbox_worker", "mkbucket", "--endpoint", endpoint]
            + ["--bucket", "bench", "--out", "-"],
            env=bench_env(srv.env()),
            check=True,
            capture_output=True,
        )

    def s3(self, kind: str) -> tuple[S3Transport, dict[str, str]]:
        """The regions' transport to the store ``kind`` and the environment its clients need."""
        srv = self.stores[kind]
        t = S3Transport(
            bucket="bench",
            prefix="peer",
            endpoint_url=srv.endpoint_url,
            addressing_style="path",
            region_name="us-east-1",
        )
        return t, srv.env()

    def cut_s3(self, kind: str, cut: bool) -> None:
        """Make the store ``kind`` unreachable (its packets dropped in the hub: connections hang, as when a
        link or a region's endpoint fails) or reachable again. The store keeps running, with its data."""
        if self.star is None:
            raise RuntimeError("an unreachable store needs the emulated WAN")
        rule = ["INPUT", "-p", "tcp", "--dport", str(self.stores[kind].port), "-j", "DROP"]
        subprocess.run([*self.prefix("hub"), "iptables", "-A" if cut else "-D", *rule], check=True)

    def stop(self) -> None:
        self.stop_lighthouse()
        for srv in self.stores.values():
            srv.stop()
        self.stores.clear()


def _launch(
    net: Net,
    root: Path,
    cfg: Path,
    data: Path,
    sz: Sizes,
    v: V,
    r: str,
    *,
    restart: bool = False,
    elastic: bool = False,
) -> RegionRun:
    """Replica ``r`` of run ``v``: a torchrun of :data:`NPROC` processes in its own namespace (the WAN) or on
    this host. ``restart``: after a kill (torchft heals from a live peer; ours resumes from its checkpoint and
    catches up from the mailbox). ``elastic``: ours with ``min_regions: 1`` (torchft's lighthouse decides
    that side: :meth:`Net.start_lighthouse`)."""
    env = {ENV_STEP_SLEEP: repr(sz.sleep_s)}
    if v.system == "torchft":
        args = ["--config", str(cfg), "--replica", r, "--out", str(root / r), "--inner-steps", str(sz.h)]
        args += [
            "--fragments",
            str(v.frags),
            "--delay",
            str(v.tau),
            "--alpha",
            str(ALPHA if v.frags > 1 else 0.0),
        ]
        args += ["--outer-lr", repr(OUTER_LR), "--outer-momentum", repr(OUTER_MOMENTUM)]
        env["TORCHFT_LIGHTHOUSE"] = net.lighthouse_url
        # the replica's store is the rendezvous of torchft's cross-replica group: on the replica's address
        cmd = _torchrun(net.prefix(r), net.addr(r), "bench.peer_torchft", args)
    else:
        env_s3: dict[str, str] = {}
        if v.transport == "s3":
            transport, env_s3 = net.s3("moto" if elastic else "nanio")
        else:
            transport = FsTransport(root=str(root / "mailbox"))
        fields: dict = {
            "enabled": True,
            "run_id": root.name,  # one per link and run: the store outlives a run
            "regions": REGIONS,
            "sync": "diloco",
            "transport": transport,
            "timeout_s": 600,
            "inner_steps": sz.h,
            "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MOMENTUM,
            "payload_dtype": v.dtype,
            "overlap": v.overlap,
            **({"min_regions": 1} if elastic else {"keep_rounds": 1}),
            **(
                {"fragments": v.frags, "fragment_delay_steps": v.tau, "fragment_alpha": ALPHA}
                if v.frags > 1
                else {}
            ),
        }
        xr = CrossRegion(region=r, **fields)
        resume = "auto" if restart else "none"
        args = [
            "--config",
            str(cfg),
            "--run-dir",
            str(root / r),
            "--resume",
            resume,
            "--data-path",
            str(data),
        ]
        cmd = _torchrun(net.prefix(r), "127.0.0.1", "sbatch_gen.train", [*args, *to_argv(xr)])
        env.update(env_s3)
    return _start(cmd, bench_env(env), root / "logs" / f"{r}.log", r, root / r)


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
    root = work / f"{re.sub(r'[^a-z0-9]+', '-', link.lower()).strip('-')}-{v.name}"
    before = net.bytes()
    t0 = time.monotonic()
    if v.system == "torchft":
        net.start_lighthouse(len(REGIONS))
    try:
        _finish([_launch(net, root, cfg, data, sz, v, r) for r in REGIONS], f"{link} {v.label}")
    finally:
        net.stop_lighthouse()
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
# faults: the same schedule on both sides


FAULTS = {
    "one": "replica b killed (SIGKILL of its torchrun and workers) mid-round, started again {away:g} s later",
    "both": "both replicas killed mid-round, both started again {away:g} s later",
    "coordinator": "the coordinator lost for {outage:g} s (torchft: its lighthouse killed, then started "
    "again on the same address; ours: the S3 store unreachable, its packets dropped in the hub)",
}


_SURVIVORS = {"one": {"a"}, "both": set(), "coordinator": set(REGIONS)}  # who trains on through each fault


def _fault_run(net: Net, work: Path, cfg: Path, data: Path, sz: Sizes, system: str, fault: str) -> dict:
    """One fault run: both replicas train, elastic (torchft: lighthouse ``--min_replicas 1``; ours:
    ``min_regions: 1``, grace and heartbeat at their defaults), without overlap; when a has logged
    ``fault_step`` the fault comes, and the schedule goes on. Nothing here raises for how a replica ended:
    a crash is a result."""
    v = V(system, "gloo", "fp32") if system == "torchft" else V(system, "s3", "bf16")
    root = work / f"fault-{fault}-{system}"
    log = "rank0.jsonl" if system == "torchft" else "metrics.jsonl"
    watch = {r: _Watch(root / r / log) for r in REGIONS}
    if system == "torchft":
        net.start_lighthouse(1)
    runs = {r: _launch(net, root, cfg, data, sz, v, r, elastic=True) for r in REGIONS}
    started = list(runs.values())
    t0 = time.time()
    t_fault = t_back = float("nan")
    rcs: dict[str, int | str] = {}
    ended: dict[str, float] = {}  # seconds after the fault each replica's (last) process exited
    coordinator_down = False
    try:
        deadline = time.monotonic() + TIMEOUT

        def poll() -> None:
            for w in watch.values():
                w.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault {fault} {system}: not done in {TIMEOUT} s")

        while not any(rec["step"] >= sz.fault_step for _, rec in watch["a"].seen):
            if any(r.poll()[0] is not None for r in runs.values()):
                raise RuntimeError(
                    f"fault {fault} {system}: a replica exited before the fault:\n{runs['a'].tail()}"
                )
            poll()
            time.sleep(0.02)
        t_fault = time.time()
        killed = {"one": ["b"], "both": list(REGIONS)}.get(fault, [])
        for r in killed:
            runs[r].kill()
        if fault == "coordinator":
            coordinator_down = True
            if system == "torchft":
                net.stop_lighthouse(kill=True)
            else:
                net.cut_s3("moto", True)
        until = t_fault + (sz.outage_s if fault == "coordinator" else sz.away_s)
        while time.time() < until:
            poll()
            time.sleep(0.02)
        if fault == "coordinator":
            if system == "torchft":
                net.start_lighthouse()
            else:
                net.cut_s3("moto", False)
            coordinator_down = False
        for r in killed:
            runs[r] = _launch(net, root, cfg, data, sz, v, r, restart=True, elastic=True)
            started.append(runs[r])
        t_back = time.time()
        while len(rcs) < len(REGIONS):
            for r, run_ in runs.items():
                if r not in rcs and run_.poll()[0] is not None:
                    rcs[r] = run_.poll()[0]
                    ended[r] = time.time() - t_fault
            poll()
            time.sleep(0.05)
    except TimeoutError:
        for r in REGIONS:
            rcs.setdefault(r, "timeout")
    finally:
        for run_ in started:
            if run_.poll()[0] is None:
                run_.kill()
        if system == "torchft":
            net.stop_lighthouse()
        if coordinator_down and system == "ours":
            net.cut_s3("moto", False)
        for w in watch.values():
            w.poll()
    rcs = {r: rcs[r] for r in REGIONS}
    out = {
        "system": system,
        "fault": fault,
        "rcs": rcs,
        "took_s": time.time() - t0,
        # a replica that failed: when, and the last error its log names
        "failed": {r: (ended.get(r), _last_error(runs[r].tail())) for r in REGIONS if rcs[r] != 0},
    }
    resumed = None
    if system == "ours" and (root / "b" / "summary.json").is_file():
        resumed = json.loads((root / "b" / "summary.json").read_text()).get("resumed_from_step")
    out.update(_fault_figures(watch, sz, system, fault, t_fault, t_back, resumed))
    models = {r: root / r / "model.safetensors" for r in REGIONS}
    out["heldout"] = {
        r: heldout_loss(m, {**sz.model, "dropout": 0.0}, data / f"{HELDOUT}.bin", sz.eval_windows)
        for r, m in models.items()
        if m.is_file() and rcs.get(r) == 0
    }
    out["same"] = _distance(*models.values())[0] if len(out["heldout"]) == len(REGIONS) else None
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"  peer fault {fault}: {system}: exits {rcs}, survivor stall {out['stall_s']}, back {out['back_s']}, "
        f"held-out {out['heldout']} ({out['took_s']:.0f} s)",
        flush=True,
    )
    return out


def _last_error(log: str) -> str:
    """The last line of a failed replica's log that names an exception (torchrun's own wrapper left out)."""
    hits = [
        x
        for x in log.splitlines()
        if re.search(r"\w+(Error|Exception|Timeout)\b", x) and "ChildFailed" not in x
    ]
    return hits[-1].strip()[-300:] if hits else "(no error in the log)"


def _fault_figures(
    watch: dict, sz: Sizes, system: str, fault: str, t_fault: float, t_back: float, resumed: int | None
) -> dict:
    """From the records as they appeared: the survivors' longest step after the fault beyond their usual
    step (the stall), when the restarted replica b stepped again and rejoined the group, and how (ours:
    ``resumed``, the checkpoint step its summary names)."""
    normal = median([rec["step_time_s"] for t, rec in watch["a"].seen if t < t_fault][1:])
    survivors = _SURVIVORS[fault]
    stall = max(
        (rec["step_time_s"] - normal for r in survivors for t, rec in watch[r].seen if t > t_fault),
        default=None,
    )
    out: dict = {"stall_s": stall, "back_s": None, "rejoin_s": None, "path": "-", "killed_at": None}
    if fault == "coordinator":
        # steps trained while the coordinator was down, and the last step before it came back
        out["steps_during"] = {
            r: sum(1 for t, rec in watch[r].seen if t_fault < t < t_fault + sz.outage_s) for r in REGIONS
        }
        return out
    r = "b"
    before = [rec["step"] for t, rec in watch[r].seen if t < t_fault]
    after = [(t, rec) for t, rec in watch[r].seen if t > t_back]
    out["killed_at"] = max(before, default=0)
    if after:
        out["back_s"] = after[0][0] - t_back
    events = [(t, rec) for t, rec in watch[r].records if t > t_back and "event" in rec]
    if system == "torchft":
        healed = [(t, rec) for t, rec in events if rec["event"] == "healed"]
        if healed:
            out["rejoin_s"] = healed[0][0] - t_back
            out["path"] = f"healed from a's live state to step {healed[0][1]['to_step']}"
        elif after:
            out["path"] = f"started again at step {after[0][1]['step']} (no live peer to heal from)"
    else:
        rejoin = [(t, rec) for t, rec in events if rec["event"] == "xr_rejoin"]
        how = "started afresh" if resumed is None else f"resumed its checkpoint of step {resumed}"
        if rejoin:
            t, rec = rejoin[0]
            out["rejoin_s"] = t - t_back
            via = "+".join(rec.get("via") or ["rounds"])
            out["path"] = (
                f"{how}; caught up {rec['replayed']} rounds from the mailbox ({via}) to step {rec['adopted_step']}"
            )
        else:
            out["path"] = f"{how}; nothing to catch up"
            out["rejoin_s"] = out["back_s"]
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
    faults: list[dict] = []
    fault_link = "-"
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
        fcfg = _config(
            work / "fault.yaml",
            steps=sz.h * sz.fault_rounds,
            model=sz.model,
            batch=sz.batch,
            data_dir=data,
            ckpt_every=sz.h,  # ours resumes a restarted replica from its newest checkpoint
            warmup=1,
        )
        fsz = replace(sz, sleep_s=sz.fault_sleep_s)
        # loopback: the systems' own costs, no network; then each emulated link; the faults on the first
        net = Net(None, work)
        for v in sz.variants(wan=False):
            rows.append(_one(net, work, cfg, data, sz, v, "loopback"))
        links = sz.links if why is None else ()
        if not links and sz.faults:
            net.start_s3("moto")
            try:
                faults = [
                    _fault_run(net, work, fcfg, data, fsz, sy, f)
                    for f in sz.faults
                    if f != "coordinator"  # an unreachable store needs the WAN's namespaces
                    for sy in SYSTEMS
                ]
            finally:
                net.stop()
            fault_link = "loopback"
        for k, (rate, rtt) in enumerate(links):
            link = f"{rate} Mbit/s, {rtt:g} ms"
            with Star(rate_mbit=rate, rtt_ms=rtt, window_kb=sz.window_kb) as star:
                net = Net(star, work)
                net.start_s3("nanio")
                if k == 0 and sz.faults:
                    net.start_s3("moto")
                try:
                    for v in sz.variants(wan=True):
                        rows.append(_one(net, work, cfg, data, sz, v, link))
                    if k == 0:
                        faults = [
                            _fault_run(net, work, fcfg, data, fsz, sy, f) for f in sz.faults for sy in SYSTEMS
                        ]
                        fault_link = link
                finally:
                    net.stop()
                res.setup.append(f"**{link}**: {star.describe()}")
        if sz.links and why is not None:
            res.notes.append(f"No emulated WAN ({why}): loopback only, the goals not judged.")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(res, sz, rows, why)
    _report_faults(res, sz, faults, fault_link)
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
        f"this machine's {os.cpu_count()} cores; a {m['n_layers']}-layer width-{m['d_model']} GPT, "
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
        "(torchft's bytes) and bf16 (our default); elastic runs (the faults) over moto in the hub, which honours "
        "the conditional writes our `min_regions` below all needs (nanio ignores them).",
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
    # goals: ours (its default payload, bf16; --quick: fp32) against torchft, per link and overlap mode
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
                and r["variant"].dtype == sz.payloads[-1]
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


def _report_faults(res: Result, sz: Sizes, faults: list[dict], link: str) -> None:
    if not faults:
        res.goal("faults: the same schedule on both sides", "not run", None)
        return
    res.setup.append(
        f"Faults, on {link}: {sz.h * sz.fault_rounds} steps (H={sz.h}), a per-step sleep of {sz.fault_sleep_s:g} s, "
        "no overlap, elastic on both sides at their defaults otherwise: torchft's lighthouse `--min_replicas 1` "
        "(heartbeat timeout 5 s), a `Manager` timeout of 60 s (its default); ours `min_regions: 1` (grace_s "
        f"{CrossRegion.model_fields['grace_s'].default:g}, heartbeat_s {CrossRegion.model_fields['heartbeat_s'].default:g}), "
        f"a checkpoint every {sz.h} steps, payload bf16. Each fault comes when replica a has logged step "
        f"{sz.fault_step}: "
        + "; ".join(f"**{k}**: {FAULTS[k].format(away=sz.away_s, outage=sz.outage_s)}" for k in sz.faults)
        + ". torchft keeps no durable checkpoint (its docs leave that to the trainer), so a replica with no "
        "live peer starts again from step 0; the restarted torchft replica heals from the live one.",
    )
    res.setup.append(
        "Stall: the survivors' longest step after the fault, beyond their median step before it (both "
        "replicas for the coordinator). Back: from the restart to the restarted replica's first step; "
        "rejoined: to its heal (torchft) or its catch-up from the mailbox (ours). Times are when the bench "
        "saw each record appear (polled every 20-50 ms)."
    )
    rows = []
    for f in faults:
        rows.append(
            [
                f["fault"],
                f["system"],
                ", ".join(
                    f"{r}: completed"
                    if x == 0
                    else f"{r}: exited {x} after {f['failed'][r][0] or float('nan'):.0f} s"
                    for r, x in f["rcs"].items()
                ),
                _stall(f) if set(f["failed"]) & _SURVIVORS[f["fault"]] else f["stall_s"],
                f["back_s"],
                f["rejoin_s"],
                f["killed_at"] if f["killed_at"] is not None else "-",
                f["path"],
                ", ".join(f"{r}: {n}" for r, n in f.get("steps_during", {}).items()) or "-",
                ", ".join(f"{r}: {x:.4f}" for r, x in f["heldout"].items()) or "-",
                "-" if f["same"] is None else ("identical" if f["same"] else "differ"),
                f["took_s"],
            ]
        )
    res.table(
        "Faults: the same schedule on both sides",
        [
            "fault",
            "system",
            "ended (seconds after the fault)",
            "survivor stall s",
            "back s",
            "rejoined s",
            "b's last step before the kill",
            "catch-up",
            "steps while the coordinator was down",
            "held-out loss",
            "a == b",
            "end to end s",
        ],
        rows,
        "faults",
    )
    for f in faults:
        for r, (after, err) in f["failed"].items():
            when = f"{after:.0f} s after the fault" if after is not None else "(killed at the timeout)"
            res.notes.append(
                f"fault {f['fault']}, {f['system']}: replica {r} exited {f['rcs'][r]} {when}: `{err}`"
            )
    judge = None if res.quick else True
    for kind in sz.faults:
        by = {f["system"]: f for f in faults if f["fault"] == kind}
        if set(by) != set(SYSTEMS):
            continue
        ft, us = by["torchft"], by["ours"]
        ok_us = all(x == 0 for x in us["rcs"].values())
        ok_ft = all(x == 0 for x in ft["rcs"].values())
        lu = statistics.mean(us["heldout"].values()) if us["heldout"] else float("nan")
        lf = statistics.mean(ft["heldout"].values()) if ft["heldout"] else float("nan")
        res.goal(
            f"fault {kind}: ours completes at equal or better held-out loss",
            f"ours {'completed' if ok_us else 'did not complete'} ({lu:.4f}), torchft "
            f"{'completed' if ok_ft else 'did not complete'} ({lf:.4f})",
            judge and ok_us and (not ok_ft or lu <= lf * 1.01),
        )
        if kind != "both":
            # a survivor that failed stalled for good
            surv = _SURVIVORS[kind]
            st = {k: float("inf") if surv & set(x["failed"]) else x["stall_s"] for k, x in by.items()}
            if None not in st.values():
                res.goal(
                    f"fault {kind}: survivor stall, ours <= torchft",
                    f"ours {_stall(us)}, torchft {_stall(ft)}",
                    judge and st["ours"] <= st["torchft"],
                )


def _stall(f: dict) -> str:
    if f["failed"]:
        return "failed (" + ", ".join(f"{r} exited {f['rcs'][r]}" for r in sorted(f["failed"])) + ")"
    return f"{f['stall_s']:.1f} s"


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
