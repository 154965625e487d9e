"""Two regions on this machine, each a separate torchrun with 2 processes (gloo) running the real trainer,
synchronising only through the mailbox: a directory, or a real S3 server on 127.0.0.1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from sbatch_gen.testing.regions import launch_region
from sbatch_gen.xr_options import CrossRegion, FsTransport, S3Credentials, S3Transport

from .conftest import KEY_ENV, SECRET_ENV
from .workers import launch
from .workers import wait as _wait_workers

pytestmark = pytest.mark.slow  # torchrun regions: the multi-process tier

REGIONS = ["eu", "us"]
TIMEOUT = 240  # per region run; generous: the 2 cores are shared


def write_config(tmp_path: Path, repo: Path, name="cfg.yaml", **sections) -> Path:
    cfg = yaml.safe_load((repo / "configs" / "tiny.yaml").read_text())
    cfg["model"]["dropout"] = 0.0
    cfg["data"]["max_bytes"] = 400_000
    cfg["train"]["log_every"] = 1
    cfg["checkpoint"]["every"] = 100  # only the final save, unless a test asks for more
    for sec, vals in sections.items():
        cfg.setdefault(sec, {}).update(vals)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def xr(region, transport, **kw) -> CrossRegion:
    base = dict(
        enabled=True,
        run_id="mp",
        region=region,
        regions=REGIONS,
        inner_steps=4,
        timeout_s=120,
        transport=transport,
        shard_mb=0.05,
        threads=4,
    )
    base.update(kw)
    return CrossRegion(**base)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "model.safetensors")


def assert_same_params(a: Path, b: Path) -> None:
    import torch

    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    diff = [k for k in pa if not torch.equal(pa[k], pb[k])]
    assert not diff, f"parameters differ between regions: {diff[:5]}"
    # and the exports are the same bytes: a checksum comparison agrees (canonical header)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def run_both(runs):
    for r in runs:
        rcs = r.wait(TIMEOUT)
        assert rcs == [0] * len(rcs), f"region {r.region} exited {rcs}:\n{r.tail()}"


def train_regions(d: Path, repo: Path, data_dir: Path, shapes: dict, steps: int = 12, **xr_kw) -> None:
    """One trainer region per entry of ``shapes`` (``{region: (parallelism section, nproc)}``) over the
    directory mailbox ``d/mailbox``, run dirs ``d/<region>``, ``steps`` steps; every rank must exit 0."""
    transport = FsTransport(root=str(d / "mailbox"))
    runs = []
    for r, (parallelism, nproc) in shapes.items():
        cfg = write_config(d, repo, name=f"{r}.yaml", parallelism=parallelism)
        runs.append(
            launch_region(
                xr(r, transport, **xr_kw),
                config=cfg,
                run_dir=d / r,
                data_path=data_dir,
                max_steps=steps,
                nproc=nproc,
            )
        )
    run_both(runs)


def s3_transport(server, bucket):
    return S3Transport(
        bucket=bucket,
        prefix="xr",
        endpoint_url=server.endpoint_url,
        addressing_style="path",
        region_name="us-east-1",
        credentials=S3Credentials(access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV),
    )


@pytest.mark.parametrize("backend", ["s3-eager", "fs-2nodes", "fs-2nodes-sparse"])
def test_diloco_two_regions(backend, tmp_path, repo, data_dir, request):
    """12 steps, H=4: three outer rounds; both regions end bitwise equal; the loss goes down.
    s3-eager: two regions of one torchrun with 2 processes each, overlap eager (round t's exchange runs
    during round t+1's steps; the trainer finishes the last one after step 12). fs-2nodes: region eu is a
    2-node job (two torchrun agents, 1 process each), so shards are owned round-robin by two node leaders
    and broadcast from both. fs-2nodes-sparse: the same with payload_dtype sparse (3%; each leader computes
    the error feedback of every shard: the same bits on both). (The grad-mode and kill tests run two
    2-process regions over fs.)"""
    eager = backend == "s3-eager"
    sparse = backend == "fs-2nodes-sparse"
    two_nodes = backend.startswith("fs-2nodes")
    env = {}
    if eager:
        server = request.getfixturevalue("s3server")
        transport = s3_transport(server, request.getfixturevalue("bucket"))
        env = {
            **server.env(),
            KEY_ENV: server.env()["AWS_ACCESS_KEY_ID"],
            SECRET_ENV: server.env()["AWS_SECRET_ACCESS_KEY"],
        }
    else:
        transport = FsTransport(root=str(tmp_path / "mailbox"))
    cfg = write_config(tmp_path, repo)
    runs = []
    for r in REGIONS:
        two = two_nodes and r == "eu"
        # us keeps its outer state off the training device (outer_device_max_gib 0): same bits either way
        runs.append(
            launch_region(
                xr(
                    r,
                    transport,
                    overlap="eager" if eager else "none",
                    **({"outer_device_max_gib": 0} if r == "us" else {}),
                    # fs-2nodes: eu's two node leaders upload snapshot 2 together, in the background
                    **({"snapshot_every": 2} if not eager else {}),
                    **(dict(payload_dtype="sparse", sparse_density=0.03, shard_mb=0.0005) if sparse else {}),
                ),
                config=cfg,
                run_dir=tmp_path / r,
                data_path=data_dir,
                max_steps=12,
                env=env,
                nproc=1 if two else 2,
                nnodes=2 if two else 1,
            )
        )
    run_both(runs)
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    for r in REGIONS:
        m = metrics(tmp_path / r)
        rounds = [x for x in m if "xr_round" in x]
        joined = [8, 12, 12] if eager else [4, 8, 12]
        assert [x["xr_round"] for x in rounds] == [1, 2, 3] and [x["step"] for x in rounds] == joined
        if eager:  # launched at 4, 8, 12; joined at the next boundary, the last one after step 12
            assert [x.get("event") for x in rounds] == [None, None, "xr_final_round"]
            assert [x["xr_inflight"] for x in m if "xr_inflight" in x] == [1, 2, 3]
            assert all(x["xr_exposed_s"] <= x["xr_join_s"] + 5 for x in rounds)
        assert all(x["xr_bytes_up"] > 0 and x["xr_bytes_down"] == x["xr_bytes_up"] for x in rounds)
        assert all("time_share_xr" in x for x in m if "loss" in x)
        for x in m:  # where the time went: a round's exposed time is the step's cross-region share
            if "loss" not in x:
                continue
            shares = [x[f"time_share_{k}"] for k in ("fwd_bwd", "optimizer", "data", "comm", "xr")]
            assert all(0.0 <= v <= 1.0 for v in shares) and sum(shares) <= 1.02, x
            if "xr_round" in x and not eager:
                assert (
                    x["time_share_xr"] == pytest.approx(x["xr_exposed_s"] / x["step_time_s"])
                    and x["xr_exposed_s"] > 0
                )
            elif "xr_exposed_s" not in x and x["step"] != 12:
                assert x["time_share_xr"] == 0.0, x
        losses = [x["loss"] for x in m if "loss" in x]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
        align = [x for x in m if x.get("event") == "xr_align"]
        assert [a["action"] for a in align] == (["published"] if r == "eu" else ["adopted"])
        # who holds the outer state: every node leader 16 B/param, the other ranks nothing
        (st,) = [x for x in m if x.get("event") == "xr_outer_state"]
        leaders = [0, 1] if two_nodes and r == "eu" else [0]
        assert st["leaders"] == leaders and st["device"] == "cpu"
        per_param = 20 if eager or sparse else 16  # eager: the delta in flight; sparse: the error buffer
        assert st["bytes_per_rank"] == [per_param * st["numel"] if k in leaders else 0 for k in range(2)]
        assert ("above outer_device_max_gib 0" in st["why"]) == (r == "us")
    if two_nodes:
        shards = list((tmp_path / "mailbox" / "mp" / "r000003" / "eu").iterdir())
        assert len(shards) >= 4  # several shards, owned round-robin by the two node leaders
        logs = "".join(p.read_text() for p in tmp_path.glob("eu.node*.log"))
        assert "node 0/2" in logs and "node 1/2" in logs
        # snapshot 2 (eu is the rounds' first member), complete, with both leaders' shards
        snap = tmp_path / "mailbox" / "mp" / "_snap" / "r000002"
        assert (snap / "_complete.json").exists() and len(list((snap / "theta").iterdir())) >= 4
        events = [x.get("event") for x in metrics(tmp_path / "eu")]
        assert "xr_snapshot" in events and "xr_snapshot_failed" not in events


def test_streaming_stop_and_resume_mid_cycle_end_on_the_uninterrupted_bits(
    tmp_path, repo, data_dir, s3server, bucket
):
    """Streaming DiLoCo in the real trainer (F 2, tau 1, H 4: a round every 2 steps, merged one step later,
    the last one in finish). The reference: two 2-process regions over fs, uninterrupted. Then the same over
    S3, with eu a 2-node region (two node leaders), and us stopped through its stop file mid-run (its stop
    checkpoint holds the round in flight and each fragment's tokens) and resumed with --resume auto: every
    region of both runs ends on the same bits."""
    cfg = write_config(tmp_path, repo)
    kw = dict(overlap="streaming", fragments=2, fragment_delay_steps=1, outer_momentum=0.5)
    ref = [
        launch_region(
            xr(r, FsTransport(root=str(tmp_path / "mailbox")), **kw),
            config=cfg,
            run_dir=tmp_path / "ref" / r,
            data_path=data_dir,
            max_steps=12,
        )
        for r in REGIONS
    ]
    run_both(ref)
    env = {
        **s3server.env(),
        KEY_ENV: s3server.env()["AWS_ACCESS_KEY_ID"],
        SECRET_ENV: s3server.env()["AWS_SECRET_ACCESS_KEY"],
    }
    transport = s3_transport(s3server, bucket)
    stop = tmp_path / "us.stop"

    def us(extra):
        return launch_region(
            xr("us", transport, **kw),
            config=cfg,
            run_dir=tmp_path / "us",
            data_path=data_dir,
            max_steps=12,
            env={**env, "SBATCH_GEN_TEST_STEP_SLEEP_S": "0.2"},
            extra_args=extra,
        )

    eu = launch_region(
        xr("eu", transport, **kw),
        config=cfg,
        run_dir=tmp_path / "eu",
        data_path=data_dir,
        max_steps=12,
        env=env,
        nproc=1,
        nnodes=2,
    )
    first = us(["--stop-file", str(stop)])
    deadline = time.monotonic() + TIMEOUT
    while not any(x.get("step", 0) >= 5 for x in metrics_or_none(tmp_path / "us")):
        assert time.monotonic() < deadline and first.poll()[0] is None, first.tail()
        time.sleep(0.05)
    stop.touch()
    assert first.wait(TIMEOUT) == [0], first.tail()
    ack = json.loads(stop.with_name(stop.name + ".ack").read_text())
    assert 5 <= ack["step"] < 12, ack
    stop.unlink()
    second = us([])
    run_both([eu, second])
    for r in REGIONS:
        assert_same_params(tmp_path / "ref" / r, tmp_path / r)
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    for run_dir in (tmp_path / "ref" / "eu", tmp_path / "eu"):
        m = metrics(run_dir)
        rounds = [x for x in m if "xr_round" in x]
        # rounds every 2 steps, fragments 0, 1 in turn, each merged a step after it started
        assert [x["xr_round"] for x in rounds] == [1, 2, 3, 4, 5, 6]
        assert [x["xr_fragment"] for x in rounds] == [0, 1, 0, 1, 0, 1]
        assert [x["step"] for x in rounds] == [3, 5, 7, 9, 11, 12]
        assert rounds[-1]["event"] == "xr_final_round"
        assert [x["xr_inflight"] for x in m if "xr_inflight" in x] == [1, 2, 3, 4, 5, 6]
        (st,) = [x for x in m if x.get("event") == "xr_outer_state"]
        assert all(b in (0, 20 * st["numel"]) for b in st["bytes_per_rank"])  # the fragment in flight: +4 B
    resumed = tmp_path / "us" / "checkpoints" / f"step-{ack['step']}"
    assert f"resumed from {resumed}" in second.tail(400)


def metrics_or_none(run_dir: Path) -> list[dict]:
    try:
        return metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_grad_mode_matches_one_ddp_run_over_both_regions(tmp_path, repo, data_dir):
    """Per-step gradient averaging across two 2-process regions == one data-parallel run over all four
    ranks' batches (reference computed here, in one process, from the same shards and samplers)."""
    import torch

    from sbatch_gen.train.config import load_config
    from sbatch_gen.train.data import Sampler, Shard, shard_path
    from sbatch_gen.train.model import GPT
    from sbatch_gen.train.optim import lr_at

    steps = 3
    cfg_path = write_config(tmp_path, repo)
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    runs = [
        launch_region(
            xr(r, transport, sync="grad", payload_dtype="fp32", keep_rounds=2),
            config=cfg_path,
            run_dir=tmp_path / r,
            data_path=data_dir,
            max_steps=steps,
        )
        for r in REGIONS
    ]
    run_both(runs)
    assert_same_params(tmp_path / "eu", tmp_path / "us")

    cfg = load_config(cfg_path)
    t, o = cfg.train, cfg.optim

    def reference(regions):
        torch.manual_seed(t.seed)
        model = GPT(cfg.model)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(cfg, 1),
            betas=(o.beta1, o.beta2),
            eps=o.eps,
        )
        feeds = []
        for r in regions:
            shard = Shard.open(shard_path(data_dir, r))
            for rank in range(2):
                feeds.append(
                    (shard, Sampler(shard.tokens.size, cfg.model.seq_len, t.batch_size, rank, 2, t.seed))
                )
        for step in range(1, steps + 1):
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step)
            opt.zero_grad()
            for shard, sampler in feeds:
                x, y = sampler.batch(shard.tokens)
                (model(torch.from_numpy(x), torch.from_numpy(y)) / len(feeds)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
        return model.state_dict()

    got = final_params(tmp_path / "eu")

    def worst(ref):
        return max((got[k].double() - ref[k].double()).abs().max().item() for k in got)

    both_regions, eu_only = worst(reference(REGIONS)), worst(reference(["eu"]))
    assert both_regions < 1e-4, both_regions
    assert eu_only > 100 * both_regions, (eu_only, both_regions)  # the tolerance is meaningful
    m = metrics(tmp_path / "eu")
    assert [x["xr_round"] for x in m if "xr_round" in x] == list(range(1, steps + 1))


def test_kill_one_region_then_resume(tmp_path, repo, data_dir):
    """us runs ahead (eu is slow) and is SIGKILLed while it waits in round 4 (step 16), after publishing it
    and before its step-16 checkpoint. Restarted with --resume auto from step 8 it fast-forwards through
    the committed round 3, trains steps 13-16 and re-enters round 4, which it had published (it reuses
    its published payload, exactly what eu used); both regions finish with identical parameters."""
    cfg = write_config(tmp_path, repo, checkpoint={"every": 8, "keep_last": 3}, train={"steps": 20})
    mbx = tmp_path / "mailbox"
    transport = FsTransport(root=str(mbx))
    sleep = {"eu": "0.3", "us": "0"}
    launch = {
        r: (
            lambda r=r: launch_region(
                xr(r, transport, timeout_s=180),
                config=cfg,
                run_dir=tmp_path / r,
                data_path=data_dir,
                env={"SBATCH_GEN_TEST_STEP_SLEEP_S": sleep[r]},
            )
        )
        for r in REGIONS
    }
    eu, us = launch["eu"](), launch["us"]()
    r4 = mbx / "mp" / "r000004"
    deadline = time.monotonic() + TIMEOUT
    while not (r4 / "us.done").exists():  # us published round 4 and now waits for eu
        assert time.monotonic() < deadline and us.poll()[0] is None and eu.poll()[0] is None, (
            us.tail() + eu.tail()
        )
        time.sleep(0.02)
    assert not (r4 / "eu.done").exists(), "eu was too fast for this test"
    us.kill()
    assert not (tmp_path / "us" / "checkpoints" / "step-16").exists()
    us2 = launch["us"]()
    run_both([eu, us2])
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    m = metrics(tmp_path / "us")
    rounds = [(x["xr_round"], x["xr_reused"]) for x in m if "xr_round" in x]
    # first life: rounds 1-3 (killed inside 4); second life from step 8: round 3 replayed from the
    # mailbox (fast-forward), round 4 re-entered with the published payload, then 5. If eu closed round 4
    # (with us's published payload) before us was back, the fast-forward replays it too.
    rejoin = [x for x in m if x.get("event") == "xr_rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["from_round"] == 2 and rejoin[0]["to_round"] in (3, 4), rejoin
    back = rejoin[0]["to_round"]
    # the run's step: the rounds' step plus the estimated steps the run is into the next round
    assert 4 * back <= rejoin[0]["adopted_step"] < 4 * back + 4
    assert rejoin[0]["adopted_step"] == 4 * back + rejoin[0]["steps_into_round"]
    expect = [(1, False), (2, False), (3, False), *([(4, True)] if back == 3 else []), (5, False)]
    assert rounds == expect, rounds
    eu_rounds = [x["xr_round"] for x in metrics(tmp_path / "eu") if "xr_round" in x]
    assert eu_rounds == [1, 2, 3, 4, 5]


# -- who holds the outer state: the outer sync alone (tests/xr/outer_worker.py), 2 regions of torchrun+gloo --


def _launch_workers(region: str, nproc: int, out: Path, **args):
    flags = [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return launch("outer_worker", region, REGIONS, nproc, out, *flags)


def _results(out: Path, region: str, nproc: int) -> list[dict]:
    import torch

    return [torch.load(out / f"{region}-rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.mark.parametrize("mode", ["diloco-eager", "grad"])
def test_only_leaders_hold_outer_state(mode, tmp_path):
    """eu: 4 ranks as 2 nodes of 2 (node leaders 0 and 2), us: 2 ranks on 1 node (leader 0; its outer state
    forced off the device by outer_device_max_gib 0). Only the leaders hold the flat fp32 buffers (20 B/param
    DiLoCo with overlap eager, 8 grad mode), the others none. grad: after every round all 6 ranks of both
    regions hold bit-identical parameters (the non-leaders get them by broadcast). DiLoCo, overlap eager (the
    leaders run each round's exchange in the background, on a gloo group of their own): at every boundary
    theta_outer is the same bits on all three leaders of both regions (eu's two leaders share the averaged
    shards); every rank of a region holds the same parameters, on a leader exactly theta_outer - early * own;
    after finish() all 6 ranks hold theta_outer. eu then resumes from its DCP checkpoint taken mid-phase with
    round 2 in flight (outer tensors saved from the leaders only) and ends on exactly the uninterrupted run's
    parameters, which only a correctly restored theta_outer, momentum and delta in flight give."""
    import torch

    eager = mode == "diloco-eager"
    layout = {"eu": (4, 2), "us": (2, 1)}  # nproc, nodes
    leaders = {"eu": [0, 2], "us": [0]}
    steps, h = (6, 2) if eager else (3, 1)
    common = dict(
        root=tmp_path / "mailbox",
        sync="diloco" if eager else "grad",
        steps=steps,
        inner_steps=h,
        **({"overlap": "eager"} if eager else {}),
    )
    runs = [
        (
            _launch_workers(
                r,
                layout[r][0],
                tmp_path / "run",
                nodes=layout[r][1],
                seed=1 + i,
                **({"save_at": 5} if r == "eu" and eager else {}),
                **({"max_gib": 0} if r == "us" else {}),
                **common,
            ),
            r,
        )
        for i, r in enumerate(REGIONS)
    ]
    _wait_workers(runs)
    res = {r: _results(tmp_path / "run", r, layout[r][0]) for r in REGIONS}
    numel = res["eu"][0]["numel"]
    per_param = 20 if eager else 8
    names = ("work", "avg", "theta_outer", "momentum", "own") if eager else ("work", "avg")
    for r in REGIONS:
        for x in res[r]:
            for bufs in x["buffers"].values():
                want = numel if x["rank"] in leaders[r] else None
                assert {n: bufs[n] for n in names} == {n: want for n in names}, (r, x["rank"], bufs)
        ev = [e for e in res[r][0]["events"] if e["event"] == "xr_outer_state"]
        assert len(ev) == 1 and ev[0]["leaders"] == leaders[r] and ev[0]["device"] == "cpu"
        assert ev[0]["bytes_per_rank"] == [
            per_param * numel if k in leaders[r] else 0 for k in range(layout[r][0])
        ]
    assert (
        "above outer_device_max_gib 0"
        in [e for e in res["us"][0]["events"] if e["event"] == "xr_outer_state"][0]["why"]
    )
    steps_done = sorted(res["eu"][0]["after"])
    assert steps_done == list(range(h, steps + 1, h))
    for s in steps_done:
        for r in REGIONS:
            for x in res[r]:
                ref = res[r if eager else "eu"][0]["after"][s]  # eager: own fresh deltas differ by region
                assert torch.equal(x["after"][s], ref), f"step {s}: {r} rank {x['rank']} differs"
                if eager and x["rank"] in leaders[r]:
                    own, early = x["early"][s]
                    assert torch.equal(x["theta"][s], res["eu"][0]["theta"][s]), f"step {s}: {r} {x['rank']}"
                    assert torch.equal(x["after"][s], x["theta"][s] - own * early), (
                        f"step {s}: {r} {x['rank']}"
                    )
        if eager:
            assert not torch.equal(res["eu"][0]["after"][s], res["us"][0]["after"][s])
    if not eager:
        return
    end = res["eu"][0]["final"][1]
    for r in REGIONS:
        for x in res[r]:
            assert x["final"][0] and torch.equal(x["final"][1], end), (r, x["rank"])
    # eu resumes from its step-5 checkpoint (other initial parameters: everything must come from the checkpoint)
    _wait_workers(
        [
            (
                _launch_workers(
                    "eu",
                    4,
                    tmp_path / "resumed",
                    nodes=2,
                    seed=99,
                    resume=tmp_path / "run" / "ckpt",
                    **common,
                ),
                "eu resumed",
            )
        ]
    )
    for x in _results(tmp_path / "resumed", "eu", 4):
        assert sorted(x["after"]) == [6]
        assert torch.equal(x["final"][1], end), f"resumed rank {x['rank']} differs"


def test_regions_with_another_outer_lr_both_stop_at_their_first_round_in_one_line(tmp_path, repo, data_dir):
    """The real trainer, two regions over fs that differ in outer_lr: both exit 1 at their first round, each
    rank's log has the one refusal line naming both regions and the setting, and no traceback of the
    trainer."""
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    cfg = write_config(tmp_path, repo)
    runs = [
        launch_region(
            xr(r, transport, outer_lr=lr),
            config=cfg,
            run_dir=tmp_path / r,
            data_path=data_dir,
            max_steps=12,
            nproc=1,
        )
        for r, lr in (("eu", 1.0), ("us", 0.5))
    ]
    for r in runs:
        assert r.wait(TIMEOUT) == [1], r.tail()
    for r in runs:
        text = "".join(p.read_text(errors="replace") for p in r.logs)
        refused = [line for line in text.splitlines() if "XRSettingsError" in line]
        assert len(refused) == 1, text[-3000:]
        assert "disagree on outer_lr:" in refused[0] and "'eu'" in refused[0] and "'us'" in refused[0]
        # (torchrun's agent prints its own traceback of the failed worker, ChildFailedError: not the trainer's)
        assert not [x for x in text.splitlines() if 'File "' in x and "/sbatch_gen/" in x], text[-3000:]
        rounds = [x for x in metrics(tmp_path / r.region) if "xr_round" in x]
        assert rounds == []


def test_a_fault_injected_from_outside_the_trainer_withholds_a_round(tmp_path, repo, data_dir):
    """bench/elastic.py's control, as it runs it: us is the trainer under ``python -m
    sbatch_gen.testing.faults`` with SBATCH_GEN_TEST_WITHHOLD_ROUNDS=us:2 (the trainer's own code has no
    hook): it publishes nothing in round 2, eu closes that round alone after grace_s, us applies it late,
    and both end on the same bits."""
    from sbatch_gen.testing.faults import ENV_WITHHOLD_ROUNDS

    transport = FsTransport(root=str(tmp_path / "mailbox"))
    cfg = write_config(tmp_path, repo)
    runs = [
        launch_region(
            xr(r, transport, min_regions=1, grace_s=3.0),
            config=cfg,
            run_dir=tmp_path / r,
            data_path=data_dir,
            max_steps=12,
            nproc=1,
            **(
                {"env": {ENV_WITHHOLD_ROUNDS: "us:2"}, "module": "sbatch_gen.testing.faults"}
                if r == "us"
                else {}
            ),
        )
        for r in REGIONS
    ]
    run_both(runs)
    rounds = {r: [x for x in metrics(tmp_path / r) if "xr_round" in x] for r in REGIONS}
    assert [x["xr_members"] for x in rounds["eu"]] == [REGIONS, ["eu"], REGIONS]
    assert [x["xr_late"] for x in rounds["us"]] == [False, True, False]
    assert rounds["us"][1]["xr_bytes_up"] == 0
    assert_same_params(tmp_path / "eu", tmp_path / "us")


def test_sparse_stop_and_resume_ends_on_the_uninterrupted_bits(tmp_path, repo, data_dir):
    """payload_dtype sparse in the real trainer (H 4, 12 steps): a reference run of two 2-process regions,
    uninterrupted; then the same with us stopped through its stop file mid-run (its stop checkpoint holds
    its error-feedback buffer, saved by DCP) and resumed with --resume auto. Every region of both runs ends
    on the same bits; the resumed region logged no buffer reset."""
    cfg = write_config(tmp_path, repo)
    kw = dict(payload_dtype="sparse", sparse_density=0.03)

    def region(r, mailbox, run_dir, **extra):
        return launch_region(
            xr(r, FsTransport(root=str(tmp_path / mailbox)), **kw),
            config=cfg,
            run_dir=run_dir,
            data_path=data_dir,
            max_steps=12,
            **extra,
        )

    run_both([region(r, "ref-mailbox", tmp_path / "ref" / r) for r in REGIONS])
    stop = tmp_path / "us.stop"
    eu = region("eu", "mailbox", tmp_path / "eu")
    first = region(
        "us",
        "mailbox",
        tmp_path / "us",
        env={"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.2"},
        extra_args=["--stop-file", str(stop)],
    )
    deadline = time.monotonic() + TIMEOUT
    while not any(x.get("step", 0) >= 5 for x in metrics_or_none(tmp_path / "us")):
        assert time.monotonic() < deadline and first.poll()[0] is None, first.tail()
        time.sleep(0.05)
    stop.touch()
    assert first.wait(TIMEOUT) == [0], first.tail()
    ack = json.loads(stop.with_name(stop.name + ".ack").read_text())
    assert 5 <= ack["step"] < 12, ack
    stop.unlink()
    second = region("us", "mailbox", tmp_path / "us")
    run_both([eu, second])
    for r in REGIONS:
        assert_same_params(tmp_path / "ref" / r, tmp_path / r)
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    resumed = tmp_path / "us" / "checkpoints" / f"step-{ack['step']}"
    assert f"resumed from {resumed}" in second.tail(400)
    events = [x.get("event") for x in metrics(tmp_path / "us")]
    assert "xr_error_feedback_reset" not in events
    rounds = [x for x in metrics(tmp_path / "us") if "xr_round" in x]
    assert all(x["xr_sparse_density"] == 123 / 4096 for x in rounds)


def test_a_compiled_region_and_an_eager_one_end_on_the_same_bits(tmp_path, repo, data_dir):
    """DiLoCo between a region whose blocks are compiled (train.compile) and an eager one (one process
    each): the compiled model keeps the eager parameter names, so the two exchange the same flat vector, and
    after the last round both hold the same outer parameters, bit for bit."""
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    runs = []
    for r in REGIONS:
        train = {"compile": r == "eu"}
        cfg = write_config(tmp_path, repo, name=f"{r}.yaml", train=train)
        runs.append(
            launch_region(
                xr(r, transport), config=cfg, run_dir=tmp_path / r, data_path=data_dir, max_steps=8, nproc=1
            )
        )
    run_both(runs)
    assert "train.compile: 2 blocks compiled in place" in runs[0].tail(100_000)
    summaries = {r: json.loads((tmp_path / r / "summary.json").read_text())["compile"] for r in REGIONS}
    assert summaries == {"eu": "2 blocks, mode default", "us": "off"}
    for r in REGIONS:
        assert len([m for m in metrics(tmp_path / r) if "xr_round" in m and "loss" in m]) == 2  # H 4, 8 steps
    assert_same_params(tmp_path / "eu", tmp_path / "us")
