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
    base = dict(enabled=True, run_id="mp", region=region, regions=REGIONS, inner_steps=4, timeout_s=120,
                transport=transport, shard_mb=0.05, threads=4)
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


def run_both(runs):
    for r in runs:
        rcs = r.wait(TIMEOUT)
        assert rcs == [0] * len(rcs), f"region {r.region} exited {rcs}:\n{r.tail()}"


def s3_transport(server, bucket):
    return S3Transport(bucket=bucket, prefix="xr", endpoint_url=server.endpoint_url, addressing_style="path",
                       region_name="us-east-1",
                       credentials=S3Credentials(access_key_id_env=KEY_ENV, secret_access_key_env=SECRET_ENV))


@pytest.mark.parametrize("backend", ["s3", "fs-2nodes"])
def test_diloco_two_regions(backend, tmp_path, repo, data_dir, request):
    """12 steps, H=4: three outer rounds; both regions end bitwise equal; the loss goes down.
    s3: two regions of one torchrun with 2 processes each. fs-2nodes: region eu is a 2-node job (two
    torchrun agents, 1 process each), so shards are owned round-robin by two node leaders and broadcast
    from both. (The grad-mode and kill tests run two 2-process regions over fs.)"""
    env = {}
    if backend == "s3":
        server = request.getfixturevalue("s3server")
        transport = s3_transport(server, request.getfixturevalue("bucket"))
        env = {**server.env(), KEY_ENV: server.env()["AWS_ACCESS_KEY_ID"],
               SECRET_ENV: server.env()["AWS_SECRET_ACCESS_KEY"]}
    else:
        transport = FsTransport(root=str(tmp_path / "mailbox"))
    cfg = write_config(tmp_path, repo)
    runs = []
    for r in REGIONS:
        two = backend == "fs-2nodes" and r == "eu"
        runs.append(launch_region(xr(r, transport), config=cfg, run_dir=tmp_path / r, data_path=data_dir,
                                  max_steps=12, env=env, nproc=1 if two else 2, nnodes=2 if two else 1))
    run_both(runs)
    assert_same_params(tmp_path / "eu", tmp_path / "us")
    for r in REGIONS:
        m = metrics(tmp_path / r)
        rounds = [x for x in m if "xr_round" in x]
        assert [x["xr_round"] for x in rounds] == [1, 2, 3] and [x["step"] for x in rounds] == [4, 8, 12]
        assert all(x["xr_bytes_up"] > 0 and x["xr_bytes_down"] == x["xr_bytes_up"] for x in rounds)
        losses = [x["loss"] for x in m if "loss" in x]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
        align = [x for x in m if x.get("event") == "xr_align"]
        assert [a["action"] for a in align] == (["published"] if r == "eu" else ["adopted"])
    if backend == "fs-2nodes":
        shards = list((tmp_path / "mailbox" / "mp" / "r000003" / "eu").iterdir())
        assert len(shards) >= 4  # several shards, owned round-robin by the two node leaders
        logs = "".join(p.read_text() for p in tmp_path.glob("eu.node*.log"))
        assert "node 0/2" in logs and "node 1/2" in logs


def test_grad_mode_matches_one_ddp_run_over_both_regions(tmp_path, repo, data_dir):
    """Per-step gradient averaging across two 2-process regions == one data-parallel run over all four
    ranks' batches (reference computed here, in one process, from the same shards and samplers)."""
    import torch

    from sbatch_gen.train.config import load_config
    from sbatch_gen.train.data import Sampler, Shard, shard_path
    from sbatch_gen.train.model import GPT
    from sbatch_gen.train.trainer import lr_at

    steps = 3
    cfg_path = write_config(tmp_path, repo)
    transport = FsTransport(root=str(tmp_path / "mailbox"))
    runs = [launch_region(xr(r, transport, sync="grad", payload_dtype="fp32", keep_rounds=2), config=cfg_path,
                          run_dir=tmp_path / r, data_path=data_dir, max_steps=steps) for r in REGIONS]
    run_both(runs)
    assert_same_params(tmp_path / "eu", tmp_path / "us")

    cfg = load_config(cfg_path)
    t, o = cfg.train, cfg.optim

    def reference(regions):
        torch.manual_seed(t.seed)
        model = GPT(cfg.model)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr_at(cfg, 1), betas=(o.beta1, o.beta2), eps=o.eps)
        feeds = []
        for r in regions:
            shard = Shard.open(shard_path(data_dir, r))
            for rank in range(2):
                feeds.append((shard, Sampler(shard.tokens.size, cfg.model.seq_len, t.batch_size, rank, 2, t.seed)))
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
    launch = {r: (lambda r=r: launch_region(xr(r, transport, timeout_s=180), config=cfg, run_dir=tmp_path / r,
                                            data_path=data_dir, env={"SBATCH_GEN_STEP_SLEEP_S": sleep[r]}))
              for r in REGIONS}
    eu, us = launch["eu"](), launch["us"]()
    r4 = mbx / "mp" / "r000004"
    deadline = time.monotonic() + TIMEOUT
    while not (r4 / "us.done").exists():  # us published round 4 and now waits for eu
        assert time.monotonic() < deadline and us.poll()[0] is None and eu.poll()[0] is None, us.tail() + eu.tail()
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
