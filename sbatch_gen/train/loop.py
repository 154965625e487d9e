"""The training loop's steps: joining the cross-region run, one step (the optimizer step, the cross-region
round, the previous step's agreement read and this step's issued, the periodic checkpoint).

One step, in order: data (prefetched one micro-batch ahead) -> forward/backward (DDP averages gradients
in-region, no DDP at world size 1; FSDP reduce-scatters them) -> ``sync.before_optimizer_step``
(cross-region grad mode) -> clip -> optimizer step -> ``sync.after_optimizer_step`` (DiLoCo outer round)
-> read the previous step's agreement (its metrics record; a stop requested there stops every rank after
this step) -> issue this step's agreement, one small asynchronous all_gather (loss, stop request, this
rank's timings, grad norm) -> checkpoint when due or stopping. The host never waits for the step it has
just queued on the device.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .agreement import read_agreement
from .api import XRNoQuorum, XRTimeout
from .gradnorm import clip_grads
from .optim import lr_at
from .parallel import autocast
from .phases import Marks, PhaseClock
from .profiling import StepProfiler
from .record import StepDone
from .state import train_state

log = logging.getLogger("sbatch_gen.train")


@dataclass
class Loop:
    """This process's way through the loop: what :func:`~.finish.finish` and the summary need."""

    resumed_from: int | None  # the step this process resumed from (None: a fresh start)
    load_s: float | None  # seconds the resume took
    first_step: int = 1  # the first step this process trains
    first_step_done: float | None = None  # time.time() when that step was done
    exit_reason: str | None = None  # None while training; "stopped" or "no_quorum" once it ended early
    no_quorum: XRTimeout | None = None  # what found no cross-region quorum
    step_times: list[float] = field(default_factory=list)
    pending: tuple[Any, StepDone] | None = None  # the last step's agreement, in flight, and its StepDone


def join_run(t) -> None:
    """Cross-region only: a fresh start waits for theta0 from regions[0]; a region behind the run
    adopts the run's step. Without a quorum (no theta0, or the round pending from the last attempt still
    has none) the loop does not start: ``loop.exit_reason`` becomes "no_quorum"."""
    if t.sync is None:
        return
    loop = t.loop
    try:
        adopted: int | None = t.sync.start(t.step)
    except XRTimeout as e:
        adopted, loop.no_quorum, loop.exit_reason = None, e, "no_quorum"
    if adopted is not None:
        adopted = min(adopted, t.end_step)  # a run that has ended: nothing left to train
    if adopted is not None and adopted != t.step:
        log.info(
            "cross-region: the run is at step %d; this region continues from there (was at %d)",
            adopted,
            t.step,
        )
        t.step = adopted


def begin_loop(t) -> None:
    """What every step reuses (autocast, the parameter list, the NaN sent for an unclipped grad norm);
    the model in train mode; the metric sinks; one line naming the steps to train."""
    import torch

    loop = t.loop
    loop.first_step = t.step + 1
    t.autocast = autocast(t.device, t.par.amp_dtype)
    t.phase_clock = PhaseClock(t.device)
    t.profiler = StepProfiler.create(t.cfg.train.profile, t.run_dir, t.info.rank, t.device, loop.first_step)
    t.params = list(t.model.parameters())
    t.nan = torch.full((1,), float("nan"), dtype=torch.float64, device=t.device)
    t.par.module.train()
    # train config / profile `metrics.sinks`: rank 0 starts them here, after the resume, so a resumed
    # attempt's TensorBoard and W&B runs continue from its first step
    xr = t.xr
    t.metrics.open_sinks(
        t.cfg.metrics,
        run_id=xr.run_id if xr.enabled else t.run_dir.name,
        region=xr.region,
        first_step=loop.first_step,
    )
    if t.step < t.end_step and loop.exit_reason is None:
        log.info(
            "training steps %d..%d (%d tokens per step)",
            loop.first_step,
            t.end_step,
            t.tokens_per_step,
        )


def train_step(t) -> None:
    """One step: the optimizer step, the cross-region round (if one is due), the previous step's
    agreement (its record, and whether a stop was requested anywhere), this step's agreement issued,
    the checkpoint when due. Sets ``loop.exit_reason`` when the loop ends here: "stopped" (every rank
    stops after the same step, without this step's periodic save: :func:`~.finish.finish` saves) or
    "no_quorum" (the round found no quorum on every rank; the model holds this step's local parameters)."""
    loop = t.loop
    t0 = time.perf_counter()
    step = t.step + 1
    if t.profiler is not None:
        t.profiler.before_step(step)
    lr = lr_at(t.cfg, step)
    loss_sum, grad_norm, marks = optimizer_step(t, step, lr)
    t.step = step
    t.tokens_seen += t.tokens_per_step
    rounds = _cross_region_round(t, step)
    if rounds is None:
        return
    xr_timings, xr_final = rounds
    step = t.step
    data_s = t.batches.take_host_s()
    ta = time.perf_counter()
    # The previous step's agreement (issued one step ago; normally complete by now): its metrics
    # record, and whether a stop was requested anywhere. If so, every rank stops after this step.
    stop_now = read_agreement(t, *loop.pending) if loop.pending is not None else False
    wait_s = time.perf_counter() - ta
    comm = t.par.comm
    exposed = comm.exposed() if comm is not None else None
    fsdp = t.par.collectives.take() if t.par.collectives is not None else None
    if t.device.type == "cuda":  # the host's step, up to here (it waited for the device above)
        own_s = time.perf_counter() - t0
    else:  # the step without the waits for other ranks this host saw (FSDP on gloo: all its collectives)
        own_s = (ta - t0) - (exposed or 0.0) - ((fsdp.blocking() or 0.0) if fsdp is not None else 0.0)
    in_flight = t.agreement.issue(agreement_row(t, loss_sum, grad_norm, own_s, data_s))
    step_s = time.perf_counter() - t0
    loop.step_times.append(step_s)
    done = StepDone(
        step=step,
        lr=lr,
        tokens=t.tokens_seen,
        step_s=step_s,
        data_s=data_s,
        wait_s=wait_s,
        ddp_span=comm.span() if comm is not None else None,
        ddp_exposed=exposed,
        fsdp=fsdp,
        xr_timings=xr_timings,
        ended=time.time(),
        xr_final=xr_final,
        marks=marks,
    )
    loop.pending = (in_flight, done)
    _end_step(t, step, stop_now)
    if t.profiler is not None:
        t.profiler.after_step(step)


# (sbatch_gen.testing.faults wraps it from outside: the per-step sleep the tests and benchmarks inject)
def _cross_region_round(t, step: int) -> tuple[dict | None, dict | None] | None:
    """After the optimizer step: the cross-region round when one is due (its timings), and at the end step
    (overlap eager) the round still in flight, finished (its record). A region behind the run fast-forwards
    to the run's step (``t.step``). Returns None when the round found no quorum (``loop.exit_reason``)."""
    xr_final = None
    try:
        xr_timings = t.sync.after_step(step, t.tokens_per_step) if t.sync is not None else None
        if t.sync is not None and step == t.end_step:  # overlap eager: the round in flight, ended
            xr_final = t.sync.finish(step)
    except XRNoQuorum as e:  # every rank raised it; the model holds this step's local parameters
        t.loop.no_quorum, t.loop.exit_reason = e, "no_quorum"
        return None
    if xr_timings and "xr_adopted_step" in xr_timings:  # behind the run: fast-forwarded
        log.info(
            "cross-region: fast-forwarded from step %d to the run's step %d",
            step,
            xr_timings["xr_adopted_step"],
        )
        t.step = min(xr_timings["xr_adopted_step"], t.end_step)
    return xr_timings, xr_final


def _end_step(t, step: int, stop_now: bool) -> None:
    """The end of step ``step`` (its agreement issued, in ``loop.pending``): read it at once when the host
    waits for the device anyway; stop here when a stop was agreed; else the periodic checkpoint if due."""
    loop = t.loop
    done = loop.pending[1]
    save_now = step % t.cfg.checkpoint.every == 0 or step == t.end_step
    if done.xr_timings is not None or done.xr_final is not None or save_now:
        # This step's host waits for the device anyway: a cross-region round ran (on every rank
        # of the region: rounds are collective) or a checkpoint is due (every rank, same steps).
        # Read its agreement now: its record is written before the round's or the checkpoint's
        # results can outlive a crash, and a stop gathered with it takes effect at this step, on
        # every rank alike.
        stop_now = read_agreement(t, *loop.pending) or stop_now
        loop.pending = None
    if stop_now and step < t.end_step:
        loop.exit_reason = "stopped"
        log.info("stop requested (%s): all ranks stop after step %d", t.stop.reason(), step)
        return
    if save_now:
        t.ckpt.save(step, train_state(t), block=step == t.end_step)


def optimizer_step(t, step: int, lr: float):
    """Set the LR; forward/backward over ``grad_accum`` micro-batches (DDP all-reduces on the last
    one); the cross-region grad-mode hook; clip; optimizer step. Returns (the micro-batch losses summed,
    the grad norm before clipping or None without clipping, both still on the device; the step's
    :class:`~.phases.Marks`)."""
    import torch

    cfg, clock = t.cfg, t.phase_clock
    for g in t.optimizer.param_groups:
        g["lr"] = lr
    if t.par.comm is not None:
        t.par.comm.reset()
    if t.par.collectives is not None:
        t.par.collectives.reset()
    accum = cfg.train.grad_accum
    loss_sum = torch.zeros((), device=t.device, dtype=torch.float32)
    fwd_start = clock.mark()
    with _label(t, "forward_backward"):
        for micro in range(accum):
            x, y = t.batches.next()
            # before the last micro-batch: no gradient reduction (DDP, FSDP's unsharded accumulation)
            with t.par.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                with t.autocast:
                    loss = t.par.module(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach()
            t.batches.prefetch()  # the next micro-batch, while the device runs this backward
    fwd_end = clock.mark()
    if t.sync is not None:
        t.sync.before_optimizer_step(step, t.tokens_per_step)
    opt_start = clock.mark()
    with _label(t, "optimizer"):
        canonical = t.xr.enabled and t.xr.sync == "grad"  # every region must clip by the same bits
        grad_norm = (
            clip_grads(t.params, cfg.optim.grad_clip, t.device, canonical)
            if cfg.optim.grad_clip > 0
            else None
        )
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, Marks(fwd_start, fwd_end, opt_start, clock.mark())


def _label(t, name: str):
    """A named range in the profiler's trace while ``train.profile`` records, else a null context."""
    return t.profiler.label(name) if t.profiler is not None else contextlib.nullcontext()


def agreement_row(t, loss_sum, grad_norm, own_s: float, data_s: float):
    """This rank's row of :attr:`~.agreement.Agreement.fields` for the step just taken, on the device."""
    import torch

    device = t.device
    gpu = t.telemetry.values(t.step, t.loop.first_step, t.end_step)
    host_row = torch.tensor(
        [float(t.stop.local()), own_s, data_s, float(t.ckpt.finished_step()), *gpu], dtype=torch.float64
    )
    return torch.cat(
        [
            (loss_sum / t.cfg.train.grad_accum).to(torch.float64).reshape(1),
            host_row.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host_row,
            grad_norm.detach().to(torch.float64).reshape(1) if grad_norm is not None else t.nan,
        ]
    )
