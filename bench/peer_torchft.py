"""One rank of a torchft replica for ``python -m bench peer``: the same work as our trainer, under torchft.

Run by torchrun, one torchrun per replica (the replica's ranks are one DDP group over gloo). Everything that
makes the work "the same" comes from our trainer's own code, not a copy: the model (:class:`GPT`, seeded
the same), the data (this replica's shard, :class:`Sampler`/:class:`Batches` with the trainer's seed, rank
and world size), the inner AdamW (decay and no-decay groups, betas, eps, foreach), the learning-rate
schedule (:func:`lr_at`), the gradient clipping and the injected per-step sleep (``SBATCH_GEN_TEST_STEP_SLEEP_S``,
the compute a faster device would do). The cross-replica part is torchft's, as its documentation sets it
up: a lighthouse (``TORCHFT_LIGHTHOUSE``), a :class:`torchft.Manager` per rank with a gloo process group
across the replicas, and :class:`torchft.local_sgd.DiLoCo` with an outer SGD (Nesterov). Streaming: the
fragments are the parameter sets our ``fragments`` split makes (:func:`assign`), torchft's
``fragment_sync_delay`` is tau and ``fragment_update_alpha`` our ``fragment_alpha``.

Writes ``<out>/rank<R>.jsonl`` (one record per step: loss, step seconds, the optimizer step's seconds and
of them the seconds torchft's sync took -- it runs in DiLoCo's optimizer-step hook --, torchft's
participants and step) and, on rank 0,
``<out>/model.safetensors`` the way our trainer exports it (:func:`save_model`).

A replica restarted after a kill heals from a live peer, as torchft does: its first quorum finds it
behind and loads the peer's state; it then goes on from the group's step (an ``healed`` event). With no
live peer (both restarted) it starts again from step 0: torchft keeps no durable checkpoint of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sbatch_gen.testing.faults import ENV_STEP_SLEEP
from sbatch_gen.train.api import exit_process
from sbatch_gen.train.config import load_config
from sbatch_gen.train.data import Batches, Sampler, Shard, shard_path
from sbatch_gen.train.export import save_model
from sbatch_gen.train.model import GPT
from sbatch_gen.train.optim import build_optimizer, lr_at
from sbatch_gen.train.xr.fragments import assign


def _fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """The F modules torchft's DiLoCo syncs, one per fragment, holding the parameters our split assigns it
    (a ParameterList: torchft only walks a fragment's parameters)."""
    if n == 1:
        return [model]
    named = list(model.named_parameters())
    where = assign([k for k, _ in named], [p.numel() for _, p in named], n)
    return [
        torch.nn.ParameterList([p for (_, p), f in zip(named, where, strict=True) if f == i])
        for i in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_torchft", description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--replica", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--inner-steps", type=int, required=True)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0, help="fragment_sync_delay (tau)")
    ap.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha")
    ap.add_argument("--outer-lr", type=float, required=True)
    ap.add_argument("--outer-momentum", type=float, required=True)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="torchft's own default")
    a = ap.parse_args(argv)

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    cfg = load_config(a.config)
    t = cfg.train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    torch.manual_seed(t.seed + 1 + rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    inner = build_optimizer(model, cfg, torch.device("cpu"))  # the trainer's AdamW (foreach off CUDA)
    # one outer optimizer per fragment, as torchft's own DiLoCo trainer sets it up: a fragment's sync sets the
    # pseudo-gradients of its parameters only, and one optimizer over the whole model would also step the
    # other fragments on their inner gradients (still set inside the optimizer-step hook)
    fragments = _fragments(model, a.fragments)
    outer = [
        torch.optim.SGD(
            f.parameters(), lr=a.outer_lr, momentum=a.outer_momentum, nesterov=a.outer_momentum > 0
        )
        for f in fragments
    ]
    shard = Shard.open(shard_path(cfg.data.path, a.replica))
    sampler = Sampler(shard.tokens.size, cfg.model.seq_len, t.batch_size, rank, world, t.seed)
    batches = Batches(sampler, shard.tokens)
    sleep_s = float(os.environ.get(ENV_STEP_SLEEP, "0") or 0)

    def state_dict() -> dict:
        return {
            "model": model.state_dict(),
            "inner": inner.state_dict(),
            "outer": [o.state_dict() for o in outer],
        }

    def load_state_dict(s: dict) -> None:
        model.load_state_dict(s["model"])
        inner.load_state_dict(s["inner"])
        for o, so in zip(outer, s["outer"], strict=True):
            o.load_state_dict(so)

    timeout = timedelta(seconds=a.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,  # DiLoCo requires the synchronous quorum
        replica_id=f"replica-{a.replica}",
        timeout=timeout,
        quorum_timeout=timeout,  # torchft's default (60 s); a sync here is seconds apart
        # every replica starts from the same seeded model, the case torchft's docs give for init_sync=False.
        # With the default (True) the first quorum heals one replica from the other, and DiLoCo's first
        # quorum comes only after H inner steps: that replica's first round would be thrown away.
        init_sync=False,
    )
    a.out.mkdir(parents=True, exist_ok=True)
    log = open(a.out / f"rank{rank}.jsonl", "a")
    log.write(json.dumps({"event": "start", "time": time.time()}) + "\n")
    per_frag = a.inner_steps // a.fragments
    # registered before DiLoCo's hooks, so it runs first: when AdamW's own step ended; what follows in
    # inner.step() is torchft's sync (a fragment's quorum, allreduce, wait and outer step, when due)
    adam_done = [0.0]
    inner.register_step_post_hook(lambda *_: adam_done.__setitem__(0, time.perf_counter()))
    with DiLoCo(
        manager,
        fragments,
        inner,
        outer,
        sync_every=a.inner_steps,
        fragment_sync_delay=a.delay,
        fragment_update_alpha=a.alpha,
        backup_device=torch.device("cpu"),
    ):
        step = 0
        while step < t.steps:
            step += 1
            t0 = time.perf_counter()
            for g in inner.param_groups:
                g["lr"] = lr_at(cfg, step)
            x, y = batches.next()
            loss = ddp(x, y)
            loss.backward()
            batches.prefetch()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
            t1 = time.perf_counter()
            inner.step()
            t2 = time.perf_counter()
            inner.zero_grad(set_to_none=True)
            if sleep_s:
                time.sleep(sleep_s)
            rec = {
                "step": step,
                "loss": float(loss),
                "step_time_s": time.perf_counter() - t0,
                "opt_s": t2 - t1,
                "sync_s": t2 - adam_done[0],
                "participants": manager.num_participants(),
                "manager_step": manager.current_step(),
                "time": time.time(),
            }
            log.write(json.dumps(rec) + "\n")
            # healed from a live peer (a restarted replica's first quorum): go on from the group's step
            if manager.current_step() * per_frag > step:
                healed = manager.current_step() * per_frag
                log.write(
                    json.dumps({"event": "healed", "step": step, "to_step": healed, "time": time.time()})
                    + "\n"
                )
                step = healed
            log.flush()
    log.write(json.dumps({"event": "end", "time": time.time()}) + "\n")
    log.close()
    if rank == 0:
        tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_model(tensors, a.out / "model.safetensors", {"step": str(step)})
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    exit_process(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
