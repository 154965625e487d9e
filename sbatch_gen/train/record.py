"""A step's metrics record (``metrics.jsonl``, rank 0) and its log line, from the rows every rank gathered
for that step (:class:`~.agreement.Agreement`) and what the host kept of it (:class:`StepDone`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .metrics import memory_record, utilization
from .phases import Marks, time_shares, xr_exposed
from .telemetry import record_fields

log = logging.getLogger("sbatch_gen.train")


@dataclass
class StepDone:
    """What the metrics record of a step needs, kept until the step's agreement is read."""

    step: int
    lr: float
    tokens: int
    step_s: float
    data_s: float
    wait_s: float  # blocked reading the previous step's agreement, during this step
    ddp_span: float | None
    ddp_exposed: float | None
    fsdp: Any  # fsdp.Times | None: this step's FSDP collectives (None under DDP)
    xr_timings: dict | None
    ended: float  # time.time() when the host finished the step
    xr_final: dict | None = None  # overlap eager, the end step: the round that was in flight, finished
    marks: Marks | None = None  # the step's forward+backward and optimizer marks (host clock or CUDA events)


def step_record(t, done: StepDone, col: dict) -> dict:
    """Trainer ``t``'s record of a step, from the gathered rows ``col`` (one column per
    :attr:`~.agreement.Agreement.fields`, one entry per rank)."""
    loss = float(col["loss"].mean().item())
    tok_s = t.tokens_per_step / done.step_s
    rank_own = [float(v) for v in col["own_s"]]
    grad_norm = float(col["grad_norm"][0].item())  # the same on every rank (clipped after DDP's average)
    # In-region comm the host can see: gloo's all-reduce span (FSDP: its collectives on gloo), and on CPU
    # the wait for the per-step agreement. On CUDA that wait is the device finishing the previous step,
    # and NCCL's collectives are not visible from the host: comm_time_s is then None (absent), not 0.
    cpu = t.device.type == "cpu"
    fsdp = done.fsdp.seconds() if done.fsdp is not None else dict.fromkeys(("all_gather", "reduce_scatter"))
    span = done.ddp_span if done.fsdp is None else done.fsdp.blocking()
    comm = None if (span is None and not cpu) else (span or 0.0) + (done.wait_s if cpu else 0.0)
    return {
        "step": done.step,
        "loss": loss,
        "lr": done.lr,
        "tokens": done.tokens,
        "tokens_per_s": tok_s,
        "step_time_s": done.step_s,
        "data_time_s": done.data_s,
        "compute_time_s": rank_own[0],
        "comm_time_s": comm,
        "ddp_allreduce_s": done.ddp_span,
        "ddp_wait_s": done.ddp_exposed,
        "fsdp_all_gather_s": fsdp["all_gather"],
        "fsdp_reduce_scatter_s": fsdp["reduce_scatter"],
        "sync_wait_s": done.wait_s,
        "grad_norm": grad_norm if t.cfg.optim.grad_clip > 0 else None,
        **memory_record(t.device),
        "mfu": utilization(tok_s, t.info.world_size, t.flops_model, t.peak),
        "hfu": utilization(tok_s, t.info.world_size, t.flops_hw, t.peak),
        "rank_losses": [float(v) for v in col["loss"]],
        "rank_step_time_s": rank_own,
        "rank_data_time_s": [float(v) for v in col["data_s"]],
        "slowest_rank": int(max(range(len(rank_own)), key=lambda i: rank_own[i])),
        "world_size": t.info.world_size,
        **_phases(done, cpu),
        **record_fields(t.telemetry.columns, col),
    }


def _phases(done: StepDone, cpu: bool) -> dict:
    """The step's forward+backward and optimizer seconds, and the shares of its time (docs/trainer.md).

    CPU: host clock; the forward+backward span loses what the host spent inside it preparing batches and
    blocked in in-region collectives (DDP's wait after its own backward, FSDP's collectives on gloo), which
    count as data and comm. In-region comm is that wait plus the per-step agreement's. CUDA: device time
    between timing events (read now: the device finished that step before its agreement could be read);
    in-region comm None (NCCL's collectives are not visible from the host)."""
    if done.marks is None:
        return {}
    fwd_bwd, opt = done.marks.fwd_bwd_s(), done.marks.optimizer_s()
    comm: float | None = None
    if cpu:
        blocked = (done.ddp_exposed or 0.0) + (
            (done.fsdp.blocking() or 0.0) if done.fsdp is not None else 0.0
        )
        fwd_bwd = max(0.0, fwd_bwd - done.data_s - blocked)
        comm = blocked + done.wait_s
    shares = time_shares(
        step_s=done.step_s,
        fwd_bwd_s=fwd_bwd,
        optimizer_s=opt,
        data_s=done.data_s,
        comm_s=comm,
        xr_s=xr_exposed(done.xr_timings, done.xr_final),
    )
    return {"fwd_bwd_time_s": fwd_bwd, "optimizer_time_s": opt, **shares}


def record(t, done: StepDone, col: dict, ckpt_done) -> None:
    """rank 0: write a step's record (with the background save that completed at it, and the cross-region
    round's timings when one ran), the record of an eager round that ended there, and the log line."""
    rec = step_record(t, done, col)
    loss, tok_s, comm, mfu = rec["loss"], rec["tokens_per_s"], rec["comm_time_s"], rec["mfu"]
    if ckpt_done is not None:
        rec["checkpoint_save_s"] = ckpt_done.seconds
    if done.xr_timings:
        rec.update(done.xr_timings)
    t.metrics.write(rec)
    if done.xr_final:  # a second round ended at this step: its own record
        t.metrics.write({"event": "xr_final_round", "step": done.step, **done.xr_final})
    log.info(
        "step %d loss %.4f lr %.3g %.0f tok/s step %.3fs data %.3fs%s%s",
        done.step,
        loss,
        done.lr,
        tok_s,
        done.step_s,
        done.data_s,
        f" comm {comm:.3f}s" if comm is not None else "",
        f" mfu {mfu:.3f}" if mfu is not None else "",
    )
