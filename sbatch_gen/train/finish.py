"""The end of a process's training, on every rank alike: the last step's record, then the stop hand-off
(stopped, or no cross-region quorum: a checkpoint of where it is, and the ack for the launcher) or the
completion (the final checkpoint and the export), the summary (rank 0), and the exit code."""

from __future__ import annotations

import logging
import os
import sys

from ..contract import ENV_PINNED_CODE
from .agreement import read_agreement
from .api import XRNoQuorum
from .state import train_state

log = logging.getLogger("sbatch_gen.train")


def finish(t) -> int:
    """Trainer ``t``'s end: the last step's record (always written), then either the hand-off (stopped, or
    no quorum: :func:`hand_off`) or the completion (:func:`complete`), the summary (rank 0), and the exit
    code: 0, or EXIT_REQUEUE after a stop or without a quorum."""
    loop = t.loop
    if loop.pending is not None:  # the last step's agreement: its record (always logged)
        in_flight, done = loop.pending
        read_agreement(t, in_flight, done, last=True)
        loop.pending = None
    if getattr(t, "profiler", None) is not None:  # the loop ended inside train.profile's steps
        t.profiler.close()
    if loop.exit_reason is None:
        finish_round_in_flight(t)
    if loop.exit_reason is None:
        complete(t)
    else:
        hand_off(t)
    t.ckpt.close()
    if t.sync is not None:
        t.sync.close()  # the heartbeat stops, the mailbox's connections close
    t.barrier()
    if t.info.is_main:
        write_summary(t)
    t.metrics.close()
    return exit_code(t)


def finish_round_in_flight(t) -> None:
    """overlap eager: a round still in flight at the end (the last step's own join found no quorum, and
    this process resumed at the end step from that checkpoint) is finished here: the others' final
    round record, or no quorum again. A no-op otherwise (the last step finished it)."""
    if t.sync is None or t.step < t.end_step:
        return
    try:
        rec = t.sync.finish(t.step)
    except XRNoQuorum as e:
        t.loop.no_quorum, t.loop.exit_reason = e, "no_quorum"
        return
    if rec and t.info.is_main:
        t.metrics.write({"event": "xr_final_round", "step": t.step, **rec})


def hand_off(t) -> None:
    """Stopped or no quorum: leave the cross-region run (the other regions stop waiting for this one),
    a complete checkpoint of where we are (a fresh start that found no theta0 has nothing to save), and
    rank 0 acks the stop file for the launcher (creating it without a quorum: a restart by torchrun
    must not wait for a quorum again)."""
    no_quorum = t.loop.no_quorum
    if t.sync is not None:
        t.sync.leave(t.step, "no quorum" if no_quorum else t.stop.reason())
    res = None
    if t.step > 0:
        t.ckpt.wait()  # a periodic save in flight completes first: it is what a cut-short stop falls back to
        last = t.ckpt.last_saved
        newest = last.step if last is not None else t.loop.resumed_from
        said = t.stop.saving(t.step, newest or None)  # <stop file>.stopping for the launcher
        if t.info.is_main:
            log.info("%s", said)
        res = t.ckpt.save(t.step, train_state(t), block=True)
    reason = "no quorum" if no_quorum is not None else t.stop.reason()
    ack = t.stop.acknowledge(t.step, res.path if res else None, reason)  # each node's first rank
    if ack is not None and t.info.is_main:
        log.info("wrote %s", ack)


def complete(t) -> None:
    """The end step (or the end of a run this region joined late): leave the cross-region run, the
    last step checkpointed (unless its periodic save was it), model.safetensors exported (rank 0)."""
    from .export import export_model

    if t.sync is not None and t.step >= t.end_step:
        t.sync.leave(t.step, "finished")
    t.ckpt.close()
    last = t.ckpt.last_saved
    if t.step > 0 and (last is None or last.step != t.step):
        t.ckpt.save(t.step, train_state(t), block=True)
    if t.cfg.checkpoint.export_safetensors and t.step > 0:
        tensors = t.par.full_state_dict()  # collective under FSDP: every rank gathers, rank 0 keeps
        if t.info.is_main:
            export_model(tensors, t.step, t.cfg.model.model_dump(), t.run_dir)


def write_summary(t) -> None:
    """rank 0: summary.json, and the summary table on stderr when this process trained a step."""
    from .metrics import format_summary, memory_summary, summarize, write_json_atomic

    loop = t.loop
    exit_reason = loop.exit_reason or "completed"
    extra = {
        "model_flops_per_token": t.flops_model,
        "hardware_flops_per_token": t.flops_hw,
        "device": str(t.device),
        "parallelism": t.par.kind + (" + cpu offload" if t.cfg.parallelism.cpu_offload else ""),
        "optimizer": getattr(t, "optimizer_impl", None),
        "compile": getattr(t, "compile_state", None),
        # the process's first step, left out of step_time_s: warm-up, and with compile the compilation
        "first_step_s": loop.step_times[0] if loop.step_times else None,
        "region": t.xr.region,
        "stop_reason": t.stop.reason() if exit_reason == "stopped" else None,
        # the code the launcher pinned for the run: "<commit> <clean|dirty>" (paths.pin_code)
        "code": os.environ.get(ENV_PINNED_CODE) or None,
    }
    s = summarize(
        step_times=loop.step_times,
        tokens_per_step=t.tokens_per_step,
        first_step=loop.first_step,
        last_step=t.step,
        resumed_from=loop.resumed_from,
        process_start=t.process_start,
        first_step_done=loop.first_step_done,
        checkpoint_save_s=t.ckpt.save_times,
        load_s=loop.load_s,
        exit_reason=exit_reason,
        world_size=t.info.world_size,
        flops_per_token=(t.flops_model, t.flops_hw),
        peak_flops=t.peak,
        memory=memory_summary(t.device),
        extra=extra,
    )
    write_json_atomic(t.run_dir / "summary.json", s)
    if loop.step_times:
        print(format_summary(s), file=sys.stderr, flush=True)


def exit_code(t) -> int:
    """0 when completed; after a stop or without a quorum (with one line saying why) the stop request's
    exit code: 0 under a launcher, which reads the ack, else EXIT_REQUEUE."""
    loop = t.loop
    code = t.stop.exit_code()
    if loop.no_quorum is not None:
        saved = f"checkpointed at step {t.step}" if t.step > 0 else "nothing to checkpoint yet"
        log.error("no cross-region quorum: %s; %s, exiting %d for a requeue", loop.no_quorum, saved, code)
        return code
    if loop.exit_reason == "stopped":
        log.info("exiting %d: checkpointed at step %d, requeue me", code, t.step)
        return code
    return 0
