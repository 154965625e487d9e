"""The one per-step collective of the trainer's ranks: each rank's row (loss, stop request, timings, the
background save it saw finish, grad norm), all-gathered asynchronously and read one step later; reading it
decides the stop, completes a background save, and has the step recorded."""

from __future__ import annotations

import time

from .record import StepDone, record


class Agreement:
    """The one per-step collective, asynchronous: each rank's row of ``FIELDS`` is all-gathered with
    ``async_op=True`` at the end of a step and read at the end of the next one, so the host never
    waits for the step it has just queued (no ``cuda.synchronize``, no blocking gather, no sync
    ``.cpu()``). Every rank reads the same rows at the same step, so decisions taken from them (the stop)
    are the same on every rank, one step after the request was gathered (at once on a step that ran a
    cross-region round or saves a checkpoint: every rank does so at the same steps, and the host waits for
    the device there anyway).

    On CUDA with NCCL, ``wait()`` on the work only makes the current stream wait for the gather; the rows
    are then copied into pinned host memory (non-blocking) and an event recorded after the copy; reading
    waits for that event only, i.e. for the device to finish that step, not the one queued since. On
    gloo the work itself is waited for when read. A single process (or world size 1) gathers nothing."""

    FIELDS = ("loss", "stop", "own_s", "data_s", "saved", "grad_norm")

    def __init__(self, info, device, extra: tuple[str, ...] = ()) -> None:
        self.info, self.device = info, device
        # this run's columns: ``extra`` (the GPU telemetry, :mod:`.telemetry`) after the host's, before the
        # grad norm (the row is the loss, one host tensor, the grad norm: see loop.agreement_row)
        self.fields = self.FIELDS[:-1] + tuple(extra) + self.FIELDS[-1:]
        self.gather = info.is_distributed and info.world_size > 1
        self.stream_ordered = device.type == "cuda" and (not self.gather or info.backend == "nccl")

    def issue(self, mine):
        import torch
        import torch.distributed as dist

        work = parts = None
        if self.gather:
            parts = [torch.empty_like(mine) for _ in range(self.info.world_size)]
            work = dist.all_gather(parts, mine, async_op=True)
        if not self.stream_ordered:
            return (work, parts, mine, None, None)
        if work is not None:
            work.wait()  # NCCL: the current stream waits for the gather; the host does not
        rows = torch.stack(parts) if parts is not None else mine.unsqueeze(0)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return (None, parts, mine, host, event)

    def read(self, pending):
        """The gathered rows (CPU, one per rank), waiting for them if they are not there yet."""
        import torch

        work, parts, mine, host, event = pending
        if event is not None:
            event.synchronize()
            return host
        if work is not None:
            work.wait()
        rows = torch.stack(parts) if parts is not None else mine.unsqueeze(0)
        return rows.cpu()


def read_agreement(t, in_flight, done: StepDone, last: bool = False) -> bool:
    """Read a step's agreement (every rank, at the same step): mark a background save some rank saw
    finish as complete (every rank together), and have rank 0 record the step when it is due
    (:func:`~.record.record`). Returns whether any rank had asked to stop when it gathered."""
    loop = t.loop
    every = t.agreement.read(in_flight)
    if loop.first_step_done is None:
        # CPU: the step was done when its iteration ended; CUDA: the host learns it only now (this
        # read waited for the device to finish that step, and no longer).
        loop.first_step_done = done.ended if t.device.type == "cpu" else time.time()
    col = {name: every[:, i] for i, name in enumerate(t.agreement.fields)}
    stop = bool(col["stop"].sum().item() > 0)
    # a background save some rank saw finish: every rank marks it complete (or fails) here, together
    ckpt_done = t.ckpt.collect(int(col["saved"].max().item()))
    step = done.step
    due = (
        step % t.cfg.train.log_every == 0
        or step == t.end_step
        or stop
        or last
        or done.xr_timings
        or step == loop.first_step
    )
    if t.info.is_main and due:
        record(t, done, col, ckpt_done)
    return stop
