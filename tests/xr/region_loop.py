"""One region's training loop around the outer sync, for the overlap tests (regions as threads, no process
group): the hand-written inner steps of tests/xr/test_sync.py, every step's record where the sync did
something, and the stops, checkpoints and crashes a trainer would see."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from sbatch_gen.train.xr.errors import XRNoQuorum
from sbatch_gen.train.xr.protocol import round_tag

from .test_sync import batch, make


def while_away(root: Path, k: int, case: str, go_on: threading.Event, region: str = "eu") -> None:
    """What became of round ``k``, in flight when ``region`` stopped, before it resumes (mailbox ``root/t``):
    "manifest-lost" (its manifest deleted; the round still open), "committed-while-away" (``go_on`` lets the
    other region go on, and it closes the round) or "in-flight" (still open)."""
    commit = root / "t" / round_tag(k) / "_commit.json"
    if case == "manifest-lost":
        (root / "t" / round_tag(k) / f"{region}.done").unlink()
    if case == "committed-while-away":
        go_on.set()
        deadline = time.monotonic() + 60
        while not commit.exists():
            assert time.monotonic() < deadline, "the other region never closed the round"
            time.sleep(0.01)
    else:
        assert not commit.exists()


def step_once(m, opt, region, step):
    x, y = batch(region, step)
    opt.zero_grad()
    ((m(x) - y) ** 2).mean().backward()
    opt.step()


def flat_of(s) -> torch.Tensor:
    """The model's parameters in the sync's flat order (with streaming: fragment after fragment)."""
    return s.flat.gather(torch.empty(s.numel)).clone()


def checkpoint(m, opt, s, step) -> dict:
    return dict(
        model={k: v.clone() for k, v in m.state_dict().items()},
        opt=opt.state_dict(),
        outer={k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.state_dict().items()},
        step=step,
    )


def save_and_close(out, m, opt, s, step):
    out["state"] = checkpoint(m, opt, s, step)
    s.close()
    return out


def run_region(
    region,
    root,
    steps,
    *,
    tokens=None,
    gate=None,
    state=None,
    stop_at=None,
    save_at=None,
    crash_at=None,
    setup=None,
    **kw,
):
    """Train to step ``steps`` (or from ``state``: a resumed region). ``out["steps"][step]``: at every step
    where the sync did something, its record, the parameters before (``local``) and after (``model``) it
    and the outer state. ``gate(region, step)`` runs before each step; ``setup(s)`` once the sync is
    built. ``stop_at``: a planned stop there (leave, checkpoint, exit); ``save_at``: a periodic checkpoint
    there (``out["state"]``); ``crash_at``: the process dies there (no leave, no checkpoint: its
    heartbeat stops). A last round without quorum in ``finish``: checkpoint, as a trainer does."""
    m, s = make(region, root, **kw)
    if setup is not None:
        setup(s)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    first = 1
    if state is not None:
        m.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        s.load_state_dict(state["outer"])
        first = state["step"] + 1
    s.align(first - 1)
    out = {"steps": {}, "model": m, "sync": s, "theta0": s.theta_outer.clone()}
    adopted = s.catch_up(first - 1)  # a region behind the run continues at the run's step
    out["adopted"] = adopted
    step = first - 1 if adopted is None else adopted
    tok = (tokens or {}).get(region, 32)
    while step < steps:
        step += 1
        if gate:
            gate(region, step)
        step_once(m, opt, region, step)
        local = flat_of(s)
        rec = s.after_optimizer_step(step, tok)
        if rec and "xr_adopted_step" in rec:
            step = rec["xr_adopted_step"]
        elif rec is not None:
            out["steps"][step] = dict(
                rec=rec,
                local=local,
                model=flat_of(s),
                theta=s.theta_outer.clone(),
                momentum=s.momentum.clone(),
                own=s.own.clone() if s.own is not None else None,  # (overlap none: no own)
                early=getattr(s, "early", 0.0),
                error=s.error.clone() if s.error is not None else None,  # (payload_dtype sparse only)
            )
        if step == stop_at:  # a stop: the checkpoint a trainer would write, then the process ends
            s.leave(step, "stopped")
            return save_and_close(out, m, opt, s, step)
        if step == save_at:
            out["state"] = checkpoint(m, opt, s, step)
        if step == crash_at:
            s.close()
            return out
    try:
        out["final"] = s.finish(steps)
    except XRNoQuorum:  # the last round found no quorum: checkpoint (a trainer then exits for a requeue)
        return save_and_close(out, m, opt, s, steps)
    out["params"] = flat_of(s)
    out["theta_end"] = s.theta_outer.clone()
    s.close()
    return out
