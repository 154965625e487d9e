"""The training loop: DDP inside a region, checkpoints, auto-resume, graceful stop, metrics.

One step, in order: data (prefetched one micro-batch ahead) -> forward/backward (DDP averages gradients
in-region; no DDP at world size 1) -> ``sync.before_optimizer_step`` (cross-region grad mode) -> clip ->
optimizer step -> ``sync.after_optimizer_step`` (DiLoCo outer round) -> read the previous step's agreement
(its metrics record; a stop requested there stops every rank after this step) -> issue this step's
agreement, one small asynchronous all_gather (loss, stop request, this rank's timings, grad norm) ->
checkpoint when due or stopping. The host never waits for the step it has just queued on the device.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api import DiLoCo, StopRequest, XRError, XRNoQuorum, XRTimeout
from .config import TrainConfig
from .spec import EXIT_CONFIG, RunSpec

log = logging.getLogger("sbatch_gen.train")

EXIT_DISK_FULL = 1  # no space left on device; the last complete checkpoint stays loadable
# For tests, demos and benchmarks: sleep this long at the end of every step (preemption tests need
# time to act mid-run), on every rank or only on the ranks listed in ENV_STEP_SLEEP_RANKS (an injected
# straggler).
ENV_STEP_SLEEP = "SBATCH_GEN_STEP_SLEEP_S"
ENV_STEP_SLEEP_RANKS = "SBATCH_GEN_STEP_SLEEP_RANKS"


# For tests: the stop checkpoint waits this long between writing its files and marking them complete, as
# a checkpoint that takes long to save would (tests/e2e/test_preemption.py).
ENV_STOP_SAVE_HOLD = "SBATCH_GEN_STOP_SAVE_HOLD_S"


def _stop_save_hold() -> float:
    return max(0.0, float(os.environ.get(ENV_STOP_SAVE_HOLD, "0") or 0))


def _step_sleep(rank: int) -> float:
    s = float(os.environ.get(ENV_STEP_SLEEP, "0") or 0)
    ranks = os.environ.get(ENV_STEP_SLEEP_RANKS, "").strip()
    if ranks and rank not in {int(r) for r in ranks.split(",") if r.strip()}:
        return 0.0
    return s


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    world = os.environ.get("WORLD_SIZE", "1")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}/{world}] %(message)s",
        stream=sys.stderr,
        force=True,
    )


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to optim.lr, then cosine decay to optim.min_lr at train.steps. ``step`` is 1-based."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))


class _CommTimer:
    """DDP comm hook state (gloo only): when the first bucket's all-reduce was launched, when the last one
    was, and when the last one completed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.first: float | None = None
        self.launched: float | None = None
        self.last: float | None = None

    def span(self) -> float:
        """First launch to last completion (overlaps the backward)."""
        if self.first is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.first)

    def exposed(self) -> float:
        """Last launch to last completion: the last bucket is ready when this rank's backward is done, so
        this is how long the rank then waited for the all-reduce, i.e. for the slowest rank to get there."""
        if self.launched is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.launched)


def _timed_allreduce_hook(state: _CommTimer, bucket):
    """DDP's all-reduce with timestamps. Registered on gloo only: its futures complete when the reduction
    has happened. On NCCL they complete at enqueue, so a Python hook would measure nothing and only
    replace DDP's built-in C++ hook."""
    import torch.distributed as dist

    now = time.perf_counter()
    if state.first is None:
        state.first = now
    state.launched = now
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()

    def _done(f):
        state.last = time.perf_counter()
        return f.value()[0]

    return fut.then(_done)


class _Agreement:
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

    def __init__(self, info, device) -> None:
        self.info, self.device = info, device
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


@dataclass
class _StepDone:
    """What the metrics record of a step needs, kept until the step's agreement is read."""

    step: int
    lr: float
    tokens: int
    step_s: float
    data_s: float
    wait_s: float  # blocked reading the previous step's agreement, during this step
    ddp_span: float | None
    ddp_exposed: float | None
    xr_timings: dict | None
    ended: float  # time.time() when the host finished the step
    xr_final: dict | None = None  # overlap eager, the end step: the round that was in flight, finished


@dataclass
class _Loop:
    """This process's way through the loop: what :meth:`Trainer.finish` and the summary need."""

    resumed_from: int | None  # the step this process resumed from (None: a fresh start)
    load_s: float | None  # seconds the resume took
    first_step: int = 1  # the first step this process trains
    first_step_done: float | None = None  # time.time() when that step was done
    exit_reason: str | None = None  # None while training; "stopped" or "no_quorum" once it ended early
    no_quorum: XRTimeout | None = None  # what found no cross-region quorum
    step_times: list[float] = field(default_factory=list)
    sleep_s: float = 0.0  # injected at the end of every step (ENV_STEP_SLEEP)
    pending: tuple[Any, _StepDone] | None = None  # the last step's agreement, in flight, and its _StepDone


def run(spec: RunSpec, process_start: float | None = None, stop: StopRequest | None = None) -> int:
    """Train one process's part of ``spec``; returns the exit code (0, EXIT_CONFIG, EXIT_DISK_FULL, 1 on
    a cross-region failure, EXIT_REQUEUE after a stop or without a cross-region quorum)."""
    process_start = process_start or time.time()
    _setup_logging()
    # `sbatch-gen validate` rejects these at review time; here they only warn: the run itself is correct,
    # only its recovery after a crash (replaying rounds peers have deleted) would fail.
    for w in spec.xr_warnings:
        log.warning("cross-region settings vs %s: %s", spec.config_path, w)
    if stop is None:
        stop = StopRequest(spec.stop_file)
        stop.install()  # before anything slow: a signal during start-up is a stop request, not a crash

    from . import dist as dist_mod

    info, device = dist_mod.init(spec.cfg.dist.backend, spec.cfg.dist.timeout_s)
    lease = None
    try:
        lease, held_by = _take_lease(spec.run_dir, info)
        if held_by is not None:  # rank 0 said why, in one line
            stop.fatal(held_by)  # no requeue: it would find the run dir taken again, or race the other job
            return EXIT_CONFIG
        return Trainer(spec, info, device, stop, process_start).train()
    except _Fatal as e:
        log.error("%s", e)
        stop.fatal(str(e))
        return EXIT_CONFIG
    except XRError as e:  # every rank raised it: one line each, no traceback
        log.error("cross-region sync failed: %s: %s", type(e).__name__, e)
        return 1
    except Exception as e:
        from .checkpoint import checkpoints_dir, find_enospc, newest_complete

        full = find_enospc(e)
        if full is None:
            raise
        # Disk full (a checkpoint, metrics): the last complete checkpoint is intact (its marker is
        # written last, after a complete save, and older ones are pruned only after that); one line, exit 1.
        # A failed checkpoint save fails on every rank: rank 0 alone reports it. Other ranks report what
        # failed on their own (a data shard on a node's disk), without speaking for the checkpoints.
        run_dir = spec.run_dir
        where = f" writing {full.filename}" if full.filename else ""
        if info.is_main:
            log.error(
                "no space left on device%s (%s); the last complete checkpoint (%s) is kept: free space "
                "and resubmit (--resume auto continues from it)",
                where,
                full.strerror or full,
                newest_complete(run_dir) or "none yet",
            )
        elif not (full.filename and checkpoints_dir(run_dir) in Path(full.filename).parents):
            log.error("no space left on device%s (%s): free space and resubmit", where, full.strerror or full)
        return EXIT_DISK_FULL
    finally:
        if lease is not None:
            lease.release()
        stop.uninstall()
        dist_mod.shutdown(info)


def _take_lease(run_dir: Path, info):
    """rank 0 takes the run-dir lease (:mod:`.lease`); every rank learns whether another job holds it.
    Returns (rank 0's lease or None, why the run dir is taken or None)."""
    from .lease import Lease, LeaseHeld

    lease, held_by = None, None
    if info.is_main:
        try:
            lease = Lease(run_dir)
            took = lease.acquire()
            if took:
                log.warning("run dir %s: %s", run_dir, took)
            lease.start()
        except (LeaseHeld, OSError) as e:
            lease, held_by = None, str(e)
            log.error("%s", e)
    if info.is_distributed:
        import torch.distributed as dist

        box = [held_by]
        dist.broadcast_object_list(box, src=0)
        held_by = box[0]
    return lease, held_by


class _Fatal(Exception):
    """A clear, expected error (bad checkpoint choice, wrong model shape): exit 2 with one message."""


class Trainer:
    """One process of the run: the model, its optimizer, data, checkpoints and cross-region sync, built
    from ``spec``; :meth:`train` runs it to the end (or a stop) and returns the exit code."""

    def __init__(self, spec: RunSpec, info, device, stop: StopRequest, process_start: float) -> None:
        import numpy as np
        import torch

        from .checkpoint import Checkpointer
        from .data import Batches, Sampler, Shard, ensure_shard
        from .metrics import MetricsWriter, peak_flops
        from .model import GPT, flops_per_token

        cfg, xr, end_step = spec.cfg, spec.xr, spec.end_step
        self.spec, self.cfg, self.xr, self.info, self.device = spec, cfg, xr, info, device
        self.stop, self.end_step, self.process_start = stop, end_step, process_start
        self.torch = torch
        self.run_dir = spec.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        self.deterministic = t.deterministic == "on" or (t.deterministic == "auto" and device.type == "cpu")
        if self.deterministic:
            if device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        use_bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
        self.amp_dtype = torch.bfloat16 if use_bf16 else None
        log.info(
            "run dir %s; steps %d (end at %d); device %s; precision %s; deterministic %s",
            self.run_dir,
            t.steps,
            end_step,
            device,
            "bf16 autocast" if use_bf16 else "fp32",
            self.deterministic,
        )

        # Model: identical initialisation on every rank, then per-rank RNG streams (dropout).
        torch.manual_seed(t.seed)
        self.model = GPT(cfg.model).to(device)
        n_params = self.model.num_params()
        self.flops_model, self.flops_hw = flops_per_token(
            cfg.model, self.model.num_params(exclude_embeddings=True)
        )
        torch.manual_seed(t.seed + 1 + info.rank)
        np.random.seed((t.seed + 1 + info.rank) % 2**32)
        self.peak = t.peak_tflops * 1e12 if t.peak_tflops else None
        if device.type == "cuda" and self.peak is None:
            name = torch.cuda.get_device_name(device)
            self.peak = peak_flops(name)
            if self.peak is None:
                log.warning("no BF16 peak known for %r: MFU not reported (set train.peak_tflops)", name)
        log.info(
            "model: %d layers, d_model %d, %d heads, seq %d: %.2fM parameters, %.3g FLOP/token",
            cfg.model.n_layers,
            cfg.model.d_model,
            cfg.model.n_heads,
            cfg.model.seq_len,
            n_params / 1e6,
            self.flops_model,
        )

        self.comm = _CommTimer()
        # DDP only with someone to average with: at world size 1 (one GPU, as on a GH200 node) it would
        # only copy gradients into buckets and all-reduce them with itself. Everything else (process
        # group, collectives, async saves) stays the same.
        self.use_ddp = info.is_distributed and info.world_size > 1
        # The timing comm hook on gloo only (see _timed_allreduce_hook); NCCL keeps DDP's built-in hook.
        self.time_allreduce = self.use_ddp and info.backend == "gloo"
        self.ddp: torch.nn.Module = self.model  # what a step calls: DDP(model), or the model at world size 1
        # DDP: a micro-batch before the last one skips the all-reduce
        self.no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if self.use_ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(
                self.model,
                device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
            if self.time_allreduce:
                ddp.register_comm_hook(self.comm, _timed_allreduce_hook)
            self.ddp, self.no_sync = ddp, ddp.no_sync
        if not self.use_ddp:
            log.info("DDP: off (world size 1)")
        else:
            log.info(
                "DDP: on, %d ranks, %s",
                info.world_size,
                "all-reduce timed by a comm hook"
                if self.time_allreduce
                else "built-in all-reduce hook (not timed)",
            )

        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for p in self.model.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(cfg, 1),
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            **({"fused": True} if device.type == "cuda" else {"foreach": True}),
        )

        # Data: this region's shard only. A node's local rank 0 prepares a missing shard.
        if info.local_rank == 0:
            shard_file = ensure_shard(
                cfg.data.path, xr.region, list(xr.regions), cfg.data.source, cfg.data.max_bytes
            )
        self._barrier()
        if info.local_rank != 0:
            shard_file = ensure_shard(
                cfg.data.path, xr.region, list(xr.regions), cfg.data.source, cfg.data.max_bytes
            )
        self.shard = Shard.open(shard_file)
        self.sampler = Sampler(
            self.shard.tokens.size, cfg.model.seq_len, t.batch_size, info.rank, info.world_size, t.seed
        )
        log.info(
            "data: region %s shard %s: %d tokens, %d windows, sha256 %s",
            xr.region,
            shard_file,
            self.shard.tokens.size,
            self.sampler.n_windows,
            self.shard.sha256[:16],
        )
        # One micro-batch ahead; pinned host memory on CUDA (the copies never block the host).
        self.batches = Batches(self.sampler, self.shard.tokens, device, pin_memory=device.type == "cuda")
        self.tokens_per_step = t.batch_size * cfg.model.seq_len * t.grad_accum * info.world_size
        self.agreement = _Agreement(info, device)

        self.ckpt = Checkpointer(
            self.run_dir,
            info,
            device,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.async_save,
            marker_extra={
                "model": cfg.model.model_dump(),
                "world_size": info.world_size,
                "region": xr.region,
                "data_sha256": self.shard.sha256,
            },
            crc=cfg.checkpoint.verify == "crc32",
        )
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if info.is_main else None)
        # cross-region: the public wrapper (sbatch_gen.train.api), the same one a foreign trainer uses
        self.sync = (
            DiLoCo(self.model, xr, run_dir=self.run_dir, log=self._log_record, device=device)
            if xr.enabled
            else None
        )
        self.step = 0
        self.tokens_seen = 0

    # -- small helpers
    def _barrier(self) -> None:
        from .dist import barrier

        barrier(self.info, self.device)

    def _log_record(self, rec: dict) -> None:
        if self.info.is_main:
            self.metrics.write({"time": time.time(), **rec})

    def _settle_ddp_buckets(self) -> None:
        """Let DDP rebuild its gradient buckets before the first real step, in every process start.

        DDP re-orders its buckets (gradient-ready order) after its first backward. Without this, a resumed
        process reduces its first step in the initial layout while the uninterrupted run had long rebuilt,
        and with more than 2 ranks the all-reduce then sums in another order: not bitwise. One throw-away
        forward/backward on a zero batch (no optimizer step, gradients dropped, RNG restored) makes every
        start reduce in the same layout."""
        if not self.use_ddp:
            return
        torch, cfg = self.torch, self.cfg
        rng = self._rng_state()
        x = torch.zeros((cfg.train.batch_size, cfg.model.seq_len), dtype=torch.long, device=self.device)
        autocast = (
            torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)
            if self.amp_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            loss = self.ddp(x, x)
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def _rng_key(self) -> str:
        return f"rank{self.info.rank}"

    def _rng_state(self) -> dict:
        torch = self.torch
        s = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            s["cuda"] = torch.cuda.get_rng_state(self.device)
        return s

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {
            "model": msd,
            "optim": osd,
            "train": {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "sampler": self.batches.state_dict(),
                "data_sha256": self.shard.sha256,
            },
        }
        state["rng"] = {self._rng_key(): self._rng_state()}
        if self.sync is not None:
            state["outer"] = self.sync.state_dict()
        return state

    # -- resume
    def _choose_checkpoint(self, skip: set[str]) -> Path | None:
        from .checkpoint import check_complete, list_step_dirs

        mode = self.spec.resume
        if mode == "none":
            return None
        if mode == "auto":
            for _step, p in reversed(list_step_dirs(self.run_dir)):
                if str(p) in skip:
                    continue
                why = check_complete(p)
                if why is None:
                    return p
                log.warning("checkpoint %s ignored: %s", p, why)
            return None
        p = Path(mode)
        why = check_complete(p)
        if why is not None:
            raise _Fatal(f"--resume {p}: not a complete checkpoint: {why}")
        return p

    def _agree_on_checkpoint(self, skip: set[str]) -> Path | None:
        """rank 0 picks; every rank gets the same answer (or the same error)."""
        chosen: str | None = None
        error: str | None = None
        if self.info.is_main:
            try:
                p = self._choose_checkpoint(skip)
                chosen = str(p) if p is not None else None
            except _Fatal as e:
                error = str(e)
        if self.info.is_distributed:
            import torch.distributed as dist

            box = [chosen, error]
            dist.broadcast_object_list(box, src=0)
            chosen, error = box
        if error is not None:
            raise _Fatal(error)
        return Path(chosen) if chosen is not None else None

    def resume(self) -> tuple[int | None, float | None]:
        """Load the chosen checkpoint. Returns (step resumed from or None, load seconds).

        With ``--resume auto`` a checkpoint that fails to load (DCP reports a failure on any rank to
        every rank) is skipped for the next older complete one; a different model shape is fatal."""
        skip: set[str] = set()
        first_error: str | None = None
        while True:
            path = self._agree_on_checkpoint(skip)
            if path is None and skip:
                # Complete checkpoints exist and none loads: starting fresh would train over them (and
                # prune them). Say so and stop; the operator decides (fix, move them, or --resume none).
                raise _Fatal(
                    f"--resume auto: none of the {len(skip)} complete checkpoint(s) in "
                    f"{self.run_dir / 'checkpoints'} loads (newest: {first_error}); not starting "
                    "fresh over them: fix or move them, or pass --resume none"
                )
            if path is None:
                log.info(
                    "starting fresh (--resume %s, no loadable checkpoint in %s)",
                    self.spec.resume,
                    self.run_dir / "checkpoints",
                )
                return None, None
            try:
                return self._load(path)
            except _Fatal:
                raise
            except Exception as e:  # noqa: BLE001 - reported, then the next older checkpoint
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if self.spec.resume != "auto":
                    raise _Fatal(f"checkpoint {path} failed to load: {why}") from e
                log.error("checkpoint %s failed to load (%s); trying an older one", path, why)
                first_error = first_error or f"{path.name}: {why}"
                skip.add(str(path))

    def _load(self, path: Path) -> tuple[int, float]:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from .checkpoint import CheckpointError, check_model_shapes

        t0 = time.perf_counter()
        try:
            check_model_shapes(path, self.model.state_dict(), self.cfg.model.model_dump())
        except CheckpointError as e:
            raise _Fatal(str(e)) from None
        # Ask only for what the checkpoint has under rng and outer: a CPU process wrote no CUDA RNG state,
        # another world size other ranks' RNG, an older version fewer outer fields. Those keep their values.
        state = self._state()
        dropped = self.ckpt.load(path, state, optional=("rng", "outer"))
        rng = state.get("rng", {}).get(self._rng_key(), {})
        has_rng = "cpu" in rng
        has_outer = "outer" in state
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        tr = state["train"]
        self.step = int(tr["step"])
        self.tokens_seen = int(tr["tokens_seen"])
        try:
            self.batches.load_state_dict(tr["sampler"])
        except ValueError as e:
            raise _Fatal(f"checkpoint {path}: {e}") from None
        if tr.get("data_sha256") != self.shard.sha256:
            log.warning(
                "checkpoint %s was trained on data with sha256 %s, this shard is %s",
                path,
                str(tr.get("data_sha256"))[:16],
                self.shard.sha256[:16],
            )
        if has_rng:
            self.torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                self.torch.cuda.set_rng_state(rng["cuda"], self.device)
            elif f"rng.{self._rng_key()}.cuda" in dropped:
                log.warning(
                    "checkpoint %s has no CUDA RNG state for %s (written by a CPU process?): the "
                    "CUDA RNG keeps this process's seed",
                    path,
                    self._rng_key(),
                )
        else:
            log.warning(
                "checkpoint %s has no RNG state for %s (world size changed?): RNG reseeded",
                path,
                self._rng_key(),
            )
        if self.sync is not None and has_outer:
            self.sync.load_state_dict(state["outer"])
        load_s = time.perf_counter() - t0
        log.info("resumed from %s at step %d in %.2fs", path, self.step, load_s)
        return self.step, load_s

    # -- the loop
    def train(self) -> int:
        """Resume, join the cross-region run, train until the end step, a stop or a lost quorum, then
        :meth:`finish`. Returns this process's exit code."""
        self.loop = _Loop(*self.resume())
        self._settle_ddp_buckets()
        self._join_run()
        self._begin_loop()
        while self.step < self.end_step and self.loop.exit_reason is None:
            self.train_step()
        return self.finish()

    def _join_run(self) -> None:
        """Cross-region only: a fresh start waits for theta0 from regions[0]; a region behind the run
        adopts the run's step. Without a quorum (no theta0, or the round pending from the last attempt still
        has none) the loop does not start: ``loop.exit_reason`` becomes "no_quorum"."""
        if self.sync is None:
            return
        loop = self.loop
        try:
            adopted: int | None = self.sync.start(self.step)
        except XRTimeout as e:
            adopted, loop.no_quorum, loop.exit_reason = None, e, "no_quorum"
        if adopted is not None:
            adopted = min(adopted, self.end_step)  # a run that has ended: nothing left to train
        if adopted is not None and adopted != self.step:
            log.info(
                "cross-region: the run is at step %d; this region continues from there (was at %d)",
                adopted,
                self.step,
            )
            self.step = adopted

    def _begin_loop(self) -> None:
        """What every step reuses (autocast, the parameter list, the NaN sent for an unclipped grad norm,
        the injected per-step sleep); the model in train mode; one line naming the steps to train."""
        torch, loop = self.torch, self.loop
        loop.first_step = self.step + 1
        loop.sleep_s = _step_sleep(self.info.rank)
        self.autocast = (
            torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)
            if self.amp_dtype is not None
            else contextlib.nullcontext()
        )
        self.params = list(self.model.parameters())
        self.nan = torch.full((1,), float("nan"), dtype=torch.float64, device=self.device)
        self.ddp.train()
        if self.step < self.end_step and loop.exit_reason is None:
            log.info(
                "training steps %d..%d (%d tokens per step)",
                loop.first_step,
                self.end_step,
                self.tokens_per_step,
            )

    def train_step(self) -> None:
        """One step: the optimizer step, the cross-region round (if one is due), the previous step's
        agreement (its record, and whether a stop was requested anywhere), this step's agreement issued,
        the checkpoint when due. Sets ``loop.exit_reason`` when the loop ends here: "stopped" (every rank
        stops after the same step, without this step's periodic save: :meth:`finish` saves) or "no_quorum"
        (the round found no quorum on every rank; the model holds this step's local parameters)."""
        loop = self.loop
        t0 = time.perf_counter()
        step = self.step + 1
        lr = lr_at(self.cfg, step)
        loss_sum, grad_norm = self._optimizer_step(step, lr)
        self.step = step
        self.tokens_seen += self.tokens_per_step
        xr_final = None
        try:
            xr_timings = self.sync.after_step(step, self.tokens_per_step) if self.sync is not None else None
            if self.sync is not None and step == self.end_step:  # overlap eager: the round in flight, ended
                xr_final = self.sync.finish(step)
        except XRNoQuorum as e:  # every rank raised it; the model holds this step's local parameters
            loop.no_quorum, loop.exit_reason = e, "no_quorum"
            return
        if xr_timings and "xr_adopted_step" in xr_timings:  # behind the run: fast-forwarded
            log.info(
                "cross-region: fast-forwarded from step %d to the run's step %d",
                step,
                xr_timings["xr_adopted_step"],
            )
            self.step = step = min(xr_timings["xr_adopted_step"], self.end_step)
        if loop.sleep_s:
            time.sleep(loop.sleep_s)
        data_s = self.batches.take_host_s()
        ta = time.perf_counter()
        # The previous step's agreement (issued one step ago; normally complete by now): its metrics
        # record, and whether a stop was requested anywhere. If so, every rank stops after this step.
        stop_now = self._read_agreement(*loop.pending) if loop.pending is not None else False
        wait_s = time.perf_counter() - ta
        exposed = self.comm.exposed() if self.time_allreduce else None
        if self.device.type == "cuda":  # the host's step, up to here (it waited for the device above)
            own_s = time.perf_counter() - t0
        else:  # the step without the waits for other ranks this host saw
            own_s = (ta - t0) - (exposed or 0.0)
        in_flight = self.agreement.issue(self._agreement_row(loss_sum, grad_norm, own_s, data_s))
        step_s = time.perf_counter() - t0
        loop.step_times.append(step_s)
        loop.pending = (
            in_flight,
            _StepDone(
                step=step,
                lr=lr,
                tokens=self.tokens_seen,
                step_s=step_s,
                data_s=data_s,
                wait_s=wait_s,
                ddp_span=self.comm.span() if self.time_allreduce else None,
                ddp_exposed=exposed,
                xr_timings=xr_timings,
                ended=time.time(),
                xr_final=xr_final,
            ),
        )
        save_now = step % self.cfg.checkpoint.every == 0 or step == self.end_step
        if xr_timings is not None or xr_final is not None or save_now:
            # This step's host waits for the device anyway: a cross-region round ran (on every rank
            # of the region: rounds are collective) or a checkpoint is due (every rank, same steps).
            # Read its agreement now: its record is written before the round's or the checkpoint's
            # results can outlive a crash, and a stop gathered with it takes effect at this step, on
            # every rank alike.
            stop_now = self._read_agreement(*loop.pending) or stop_now
            loop.pending = None
        if stop_now and step < self.end_step:
            loop.exit_reason = "stopped"
            log.info("stop requested (%s): all ranks stop after step %d", self.stop.reason(), step)
            return
        if save_now:
            self.ckpt.save(step, self._state(), block=step == self.end_step)

    def _optimizer_step(self, step: int, lr: float):
        """Set the LR; forward/backward over ``grad_accum`` micro-batches (DDP all-reduces on the last
        one); the cross-region grad-mode hook; clip; optimizer step. Returns (the micro-batch losses summed,
        the grad norm before clipping or None without clipping), both still on the device."""
        torch, cfg = self.torch, self.cfg
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.comm.reset()
        accum = cfg.train.grad_accum
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for micro in range(accum):
            x, y = self.batches.next()
            skip_sync = self.use_ddp and micro < accum - 1
            with self.no_sync() if skip_sync else contextlib.nullcontext(), self.autocast:
                loss = self.ddp(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach()
            self.batches.prefetch()  # the next micro-batch, while the device runs this backward
        if self.sync is not None:
            self.sync.before_optimizer_step(step, self.tokens_per_step)
        grad_norm = None
        if cfg.optim.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def _agreement_row(self, loss_sum, grad_norm, own_s: float, data_s: float):
        """This rank's row of :attr:`_Agreement.FIELDS` for the step just taken, on the device."""
        torch, device = self.torch, self.device
        host_row = torch.tensor(
            [float(self.stop.local()), own_s, data_s, float(self.ckpt.finished_step())], dtype=torch.float64
        )
        return torch.cat(
            [
                (loss_sum / self.cfg.train.grad_accum).to(torch.float64).reshape(1),
                host_row.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host_row,
                grad_norm.detach().to(torch.float64).reshape(1) if grad_norm is not None else self.nan,
            ]
        )

    def _read_agreement(self, in_flight, done: _StepDone, last: bool = False) -> bool:
        """Read a step's agreement (every rank, at the same step): mark a background save some rank saw
        finish as complete (every rank together), and have rank 0 :meth:`record` the step when it is due.
        Returns whether any rank had asked to stop when it gathered."""
        loop = self.loop
        every = self.agreement.read(in_flight)
        if loop.first_step_done is None:
            # CPU: the step was done when its iteration ended; CUDA: the host learns it only now (this
            # read waited for the device to finish that step, and no longer).
            loop.first_step_done = done.ended if self.device.type == "cpu" else time.time()
        col = {name: every[:, i] for i, name in enumerate(_Agreement.FIELDS)}
        stop = bool(col["stop"].sum().item() > 0)
        # a background save some rank saw finish: every rank marks it complete (or fails) here, together
        ckpt_done = self.ckpt.collect(int(col["saved"].max().item()))
        step = done.step
        due = (
            step % self.cfg.train.log_every == 0
            or step == self.end_step
            or stop
            or last
            or done.xr_timings
            or step == loop.first_step
        )
        if self.info.is_main and due:
            self.record(done, col, ckpt_done)
        return stop

    def record(self, done: _StepDone, col: dict, ckpt_done) -> None:
        """rank 0: a step's metrics record (metrics.jsonl) and its log line, from the gathered rows
        ``col`` (one column per :attr:`_Agreement.FIELDS`, one entry per rank)."""
        from .metrics import memory_record, utilization

        cfg, info = self.cfg, self.info
        loss = float(col["loss"].mean().item())
        tok_s = self.tokens_per_step / done.step_s
        mfu = utilization(tok_s, info.world_size, self.flops_model, self.peak)
        hfu = utilization(tok_s, info.world_size, self.flops_hw, self.peak)
        rank_own = [float(v) for v in col["own_s"]]
        grad_norm = float(col["grad_norm"][0].item())  # the same on every rank (clipped after DDP's average)
        # In-region comm the host can see: gloo's all-reduce span, and on CPU the wait for the per-step
        # agreement. On CUDA that wait is the device finishing the previous step, and NCCL's all-reduce is
        # not visible from the host: comm_time_s is then None (absent), not 0.
        cpu = self.device.type == "cpu"
        comm = (
            None
            if (done.ddp_span is None and not cpu)
            else (done.ddp_span or 0.0) + (done.wait_s if cpu else 0.0)
        )
        rec = {
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
            "sync_wait_s": done.wait_s,
            "grad_norm": grad_norm if cfg.optim.grad_clip > 0 else None,
            **memory_record(self.device),
            "mfu": mfu,
            "hfu": hfu,
            "rank_losses": [float(v) for v in col["loss"]],
            "rank_step_time_s": rank_own,
            "rank_data_time_s": [float(v) for v in col["data_s"]],
            "slowest_rank": int(max(range(len(rank_own)), key=lambda i: rank_own[i])),
            "world_size": info.world_size,
        }
        if ckpt_done is not None:
            rec["checkpoint_save_s"] = ckpt_done.seconds
        if done.xr_timings:
            rec.update(done.xr_timings)
        self.metrics.write(rec)
        if done.xr_final:  # a second round ended at this step: its own record
            self.metrics.write({"event": "xr_final_round", "step": done.step, **done.xr_final})
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

    # -- the end
    def finish(self) -> int:
        """The end, on every rank alike: the last step's record (always written), then either the hand-off
        (stopped, or no quorum: :meth:`_hand_off`) or the completion (:meth:`_complete`), the summary
        (rank 0), and the exit code: 0, or EXIT_REQUEUE after a stop or without a quorum."""
        loop = self.loop
        if loop.pending is not None:  # the last step's agreement: its record (always logged)
            self._read_agreement(*loop.pending, last=True)
            loop.pending = None
        if loop.exit_reason is None:
            self._finish_round_in_flight()
        if loop.exit_reason is None:
            self._complete()
        else:
            self._hand_off()
        self.ckpt.close()
        if self.sync is not None:
            self.sync.close()  # the heartbeat stops, the mailbox's connections close
        self._barrier()
        if self.info.is_main:
            self._write_summary()
        self.metrics.close()
        return self._exit_code()

    def _finish_round_in_flight(self) -> None:
        """overlap eager: a round still in flight at the end (the last step's own join found no quorum, and
        this process resumed at the end step from that checkpoint) is finished here: the others' final
        round record, or no quorum again. A no-op otherwise (the last step finished it)."""
        if self.sync is None or self.step < self.end_step:
            return
        try:
            rec = self.sync.finish(self.step)
        except XRNoQuorum as e:
            self.loop.no_quorum, self.loop.exit_reason = e, "no_quorum"
            return
        if rec and self.info.is_main:
            self.metrics.write({"event": "xr_final_round", "step": self.step, **rec})

    def _hand_off(self) -> None:
        """Stopped or no quorum: leave the cross-region run (the other regions stop waiting for this one),
        a complete checkpoint of where we are (a fresh start that found no theta0 has nothing to save), and
        rank 0 acks the stop file for the launcher (creating it without a quorum: a restart by torchrun
        must not wait for a quorum again)."""
        no_quorum = self.loop.no_quorum
        if self.sync is not None:
            self.sync.leave(self.step, "no quorum" if no_quorum else self.stop.reason())
        res = None
        if self.step > 0:
            self.ckpt.wait()  # a periodic save in flight completes first: it is what a cut-short stop falls back to
            last = self.ckpt.last_saved
            newest = last.step if last is not None else self.loop.resumed_from
            said = self.stop.saving(self.step, newest or None)  # <stop file>.stopping for the launcher
            if self.info.is_main:
                log.info("%s", said)
            res = self.ckpt.save(self.step, self._state(), block=True, hold_s=_stop_save_hold())
        reason = "no quorum" if no_quorum is not None else self.stop.reason()
        ack = self.stop.acknowledge(self.step, res.path if res else None, reason)  # each node's first rank
        if ack is not None and self.info.is_main:
            log.info("wrote %s", ack)

    def _complete(self) -> None:
        """The end step (or the end of a run this region joined late): leave the cross-region run, the
        last step checkpointed (unless its periodic save was it), model.safetensors exported (rank 0)."""
        if self.sync is not None and self.step >= self.end_step:
            self.sync.leave(self.step, "finished")
        self.ckpt.close()
        last = self.ckpt.last_saved
        if self.step > 0 and (last is None or last.step != self.step):
            self.ckpt.save(self.step, self._state(), block=True)
        if self.info.is_main and self.cfg.checkpoint.export_safetensors and self.step > 0:
            self._export()

    def _write_summary(self) -> None:
        """rank 0: summary.json, and the summary table on stderr when this process trained a step."""
        from .metrics import format_summary, memory_summary, summarize, write_json_atomic

        loop, info, device = self.loop, self.info, self.device
        exit_reason = loop.exit_reason or "completed"
        extra = {
            "model_flops_per_token": self.flops_model,
            "hardware_flops_per_token": self.flops_hw,
            "device": str(device),
            "region": self.xr.region,
            "stop_reason": self.stop.reason() if exit_reason == "stopped" else None,
        }
        s = summarize(
            step_times=loop.step_times,
            tokens_per_step=self.tokens_per_step,
            first_step=loop.first_step,
            last_step=self.step,
            resumed_from=loop.resumed_from,
            process_start=self.process_start,
            first_step_done=loop.first_step_done,
            checkpoint_save_s=self.ckpt.save_times,
            load_s=loop.load_s,
            exit_reason=exit_reason,
            world_size=info.world_size,
            flops_per_token=(self.flops_model, self.flops_hw),
            peak_flops=self.peak,
            memory=memory_summary(device),
            extra=extra,
        )
        write_json_atomic(self.run_dir / "summary.json", s)
        if loop.step_times:
            print(format_summary(s), file=sys.stderr, flush=True)

    def _exit_code(self) -> int:
        """0 when completed; after a stop or without a quorum (with one line saying why) the stop request's
        exit code: 0 under a launcher, which reads the ack, else EXIT_REQUEUE."""
        loop = self.loop
        code = self.stop.exit_code()
        if loop.no_quorum is not None:
            saved = f"checkpointed at step {self.step}" if self.step > 0 else "nothing to checkpoint yet"
            log.error("no cross-region quorum: %s; %s, exiting %d for a requeue", loop.no_quorum, saved, code)
            return code
        if loop.exit_reason == "stopped":
            log.info("exiting %d: checkpointed at step %d, requeue me", code, self.step)
            return code
        return 0

    def _export(self) -> None:
        from ..fsutil import atomic_path
        from .export import save_model

        out = self.run_dir / "model.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.model.state_dict().items()}
        meta = {"step": str(self.step), "model": json.dumps(self.cfg.model.model_dump(), sort_keys=True)}
        with atomic_path(out, fsync=False) as tmp:
            save_model(tensors, tmp, meta)  # the same bytes in every region that ends on the same bits
        log.info("exported %d tensors to %s", len(tensors), out)
