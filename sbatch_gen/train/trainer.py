"""One process of a training run: :func:`run` (logging, the run-dir lease, errors as exit codes) and the
:class:`Trainer` it builds from the run spec: precision, the model and its optimizer, the data, checkpoints,
metrics and the cross-region sync. The trainer's other parts, by concern: :mod:`.loop` (the steps),
:mod:`.agreement` (the per-step collective), :mod:`.record` (a step's metrics record), :mod:`.resume` and
:mod:`.state` (checkpoints in and out), :mod:`.finish` (the stop hand-off, the completion, the summary),
:mod:`.parallel` (DDP in :mod:`.ddp` or FSDP2 in :mod:`.fsdp`) and :mod:`.optim`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .api import DiLoCo, StopRequest, XRError
from .ddp import settle_buckets
from .finish import finish
from .logsetup import setup_logging
from .loop import Loop, begin_loop, join_run, train_step
from .resume import Fatal, resume
from .spec import EXIT_CONFIG, RunSpec

log = logging.getLogger("sbatch_gen.train")

EXIT_DISK_FULL = 1  # no space left on device; the last complete checkpoint stays loadable


def run(spec: RunSpec, process_start: float | None = None, stop: StopRequest | None = None) -> int:
    """Train one process's part of ``spec``; returns the exit code (0, EXIT_CONFIG, EXIT_DISK_FULL, 1 on
    a cross-region failure, EXIT_REQUEUE after a stop or without a cross-region quorum)."""
    process_start = process_start or time.time()
    setup_logging()
    # `sbatch-gen validate` rejects these at review time; here they only warn: the run itself is correct,
    # only its recovery after a crash (replaying rounds peers have deleted) would fail.
    for w in spec.xr_warnings:
        log.warning("cross-region settings vs %s: %s", spec.config_path, w)
    if stop is None:
        stop = StopRequest(spec.stop_file)
        stop.install()  # before anything slow: a signal during start-up is a stop request, not a crash

    from . import dist as dist_mod

    cfg = spec.cfg
    info, device = dist_mod.init(cfg.dist.backend, cfg.dist.timeout_s, cfg.parallelism.kind == "fsdp")
    lease = None
    try:
        lease, held_by = _take_lease(spec.run_dir, info)
        if held_by is not None:  # rank 0 said why, in one line
            stop.fatal(held_by)  # no requeue: it would find the run dir taken again, or race the other job
            return EXIT_CONFIG
        return Trainer(spec, info, device, stop, process_start).train()
    except Fatal as e:
        log.error("%s", e)
        stop.fatal(str(e))
        return EXIT_CONFIG
    except XRError as e:  # every rank raised it: one line each, no traceback
        log.error("cross-region sync failed: %s: %s", type(e).__name__, e)
        return 1
    except Exception as e:
        if not _disk_full(e, spec.run_dir, info):
            raise
        return EXIT_DISK_FULL
    finally:
        if lease is not None:
            lease.release()
        stop.uninstall()
        dist_mod.shutdown(info)


def _disk_full(e: Exception, run_dir: Path, info) -> bool:
    """Whether ``e`` is a full disk (a checkpoint, metrics), said in one line: the last complete checkpoint
    is intact (its marker is written last, after a complete save, and older ones are pruned only after
    that). A failed checkpoint save fails on every rank: rank 0 alone reports it. Other ranks report what
    failed on their own (a data shard on a node's disk), without speaking for the checkpoints."""
    from .checkpoint import checkpoints_dir, find_enospc, newest_complete

    full = find_enospc(e)
    if full is None:
        return False
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
    return True


def _fenced(why: str | None) -> None:
    """The run-dir lease was taken over (by the attempt that replaced this one: Slurm requeued the job away
    from a node it lost, while this attempt ran on): stop at once, before this process writes into the run
    directory again. A hard exit of rank 0; the other ranks fail at their next collective."""
    log.error("stopping: another attempt trains in this run directory now (%s)", why)
    logging.shutdown()
    os._exit(1)


def _take_lease(run_dir: Path, info):
    """rank 0 takes the run-dir lease (:mod:`.lease`); every rank learns whether another job holds it.
    Returns (rank 0's lease or None, why the run dir is taken or None)."""
    from .lease import Lease, LeaseHeld

    lease, held_by = None, None
    if info.is_main:
        try:
            lease = Lease(run_dir, on_lost=_fenced)
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


class Trainer:
    """One process of the run: the model, its optimizer, data, checkpoints and cross-region sync, built
    from ``spec``; :meth:`train` runs it to the end (or a stop) and returns the exit code."""

    loop: Loop

    def __init__(self, spec: RunSpec, info, device, stop: StopRequest, process_start: float) -> None:
        self.spec, self.cfg, self.xr, self.info, self.device = spec, spec.cfg, spec.xr, info, device
        self.stop, self.end_step, self.process_start = stop, spec.end_step, process_start
        self.run_dir = spec.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._set_precision()
        self._build_model()
        self._build_data()
        self._build_checkpoints_and_metrics()
        # cross-region: the public wrapper (sbatch_gen.train.api), the same one a foreign trainer uses
        self.sync = (
            DiLoCo(self.model, self.xr, run_dir=self.run_dir, log=self._log_record, device=device)
            if self.xr.enabled
            else None
        )
        self.step = 0
        self.tokens_seen = 0

    def _set_precision(self) -> None:
        """Deterministic algorithms (on the CPU by default) and bf16 autocast (on CUDA by default)."""
        import torch

        t, device = self.cfg.train, self.device
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
            self.end_step,
            device,
            "bf16 autocast" if use_bf16 else "fp32",
            self.deterministic,
        )

    def _build_model(self) -> None:
        """The model (identical initialisation on every rank, then per-rank RNG streams for dropout), its
        FLOPs per token and the device's peak, DDP or FSDP around it (``parallelism.kind``), its optimizer."""
        import numpy as np
        import torch

        from .model import GPT, flops_per_token
        from .optim import adamw_implementation, build_optimizer

        cfg, info, device, t = self.cfg, self.info, self.device, self.cfg.train
        torch.manual_seed(t.seed)
        self.model = GPT(cfg.model)  # on the CPU: FSDP moves each rank's shards to where they live
        n_params = self.model.num_params()
        self.flops_model, self.flops_hw = flops_per_token(
            cfg.model, self.model.num_params(exclude_embeddings=True)
        )
        torch.manual_seed(t.seed + 1 + info.rank)
        np.random.seed((t.seed + 1 + info.rank) % 2**32)
        self._set_peak()
        self.compiled = False
        if t.compile.enabled:
            from .compiling import compile_blocks

            self.compiled = compile_blocks(self.model, device, self.deterministic, t.compile.mode)
        # summary.json's "compile": what this run did (a backend that cannot compile said why at start)
        self.compile_state = (
            f"{len(self.model.blocks)} blocks, mode {t.compile.mode}"
            if self.compiled
            else ("off (the backend cannot compile here)" if t.compile.enabled else "off")
        )
        log.info(
            "model: %d layers, d_model %d, %d heads, seq %d: %.2fM parameters, %.3g FLOP/token",
            cfg.model.n_layers,
            cfg.model.d_model,
            cfg.model.n_heads,
            cfg.model.seq_len,
            n_params / 1e6,
            self.flops_model,
        )
        if cfg.parallelism.kind == "fsdp":
            from .fsdp import shard

            self.par = shard(self.model, cfg.parallelism, info, device, self.amp_dtype)
        else:
            from .ddp import replicate

            self.par = replicate(self.model.to(device), info, device, self.amp_dtype)
        self.optimizer = build_optimizer(self.model, cfg, self.par.param_device)
        self.optimizer_impl = f"AdamW {adamw_implementation(self.par.param_device)}"
        log.info("optimizer: %s; compile: %s", self.optimizer_impl, self.compile_state)

    def _set_peak(self) -> None:
        """The device's peak FLOP/s for MFU: train.peak_tflops, else the known BF16 peak of a CUDA device."""
        import torch

        from .metrics import peak_flops

        t, device = self.cfg.train, self.device
        self.peak = t.peak_tflops * 1e12 if t.peak_tflops else None
        if device.type == "cuda" and self.peak is None:
            name = torch.cuda.get_device_name(device)
            self.peak = peak_flops(name)
            if self.peak is None:
                log.warning("no BF16 peak known for %r: MFU not reported (set train.peak_tflops)", name)

    def _build_data(self) -> None:
        """This region's shard (a node's local rank 0 prepares it when missing), this rank's sampler over
        it, and the batches, one micro-batch ahead (pinned host memory on CUDA: the copies never block)."""
        from .agreement import Agreement
        from .data import Batches, Sampler, Shard, ensure_shard
        from .telemetry import GpuTelemetry, TelemetryRow

        cfg, xr, info, device, t = self.cfg, self.xr, self.info, self.device, self.cfg.train
        if info.local_rank == 0:
            shard_file = ensure_shard(
                cfg.data.path, xr.region, list(xr.regions), cfg.data.source, cfg.data.max_bytes
            )
        self.barrier()
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
        self.batches = Batches(self.sampler, self.shard.tokens, device, pin_memory=device.type == "cuda")
        self.tokens_per_step = t.batch_size * cfg.model.seq_len * t.grad_accum * info.world_size
        # GPU telemetry (NVML) in every rank's per-step row: columns on CUDA only
        self.telemetry = TelemetryRow(device, GpuTelemetry.open(device, say=info.is_main), t.log_every)
        self.agreement = Agreement(info, device, self.telemetry.columns)

    def _build_checkpoints_and_metrics(self) -> None:
        """The checkpointer (its markers name the model, world size, region and data) and rank 0's
        metrics.jsonl writer."""
        from .checkpoint import Checkpointer
        from .metrics import MetricsWriter

        cfg, info = self.cfg, self.info
        self.ckpt = Checkpointer(
            self.run_dir,
            info,
            self.device,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.async_save,
            marker_extra={
                "model": cfg.model.model_dump(),
                "parallelism": cfg.parallelism.kind,
                "world_size": info.world_size,
                "region": self.xr.region,
                "data_sha256": self.shard.sha256,
            },
            crc=cfg.checkpoint.verify == "crc32",
        )
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if info.is_main else None)

    def barrier(self) -> None:
        from .dist import barrier

        barrier(self.info, self.device)

    def _log_record(self, rec: dict) -> None:
        if self.info.is_main:
            self.metrics.write({"time": time.time(), **rec})

    def train(self) -> int:
        """Resume, join the cross-region run, train until the end step, a stop or a lost quorum, then
        finish (:mod:`.finish`). Returns this process's exit code."""
        self.loop = Loop(*resume(self))
        settle_buckets(self)
        join_run(self)
        begin_loop(self)
        while self.step < self.end_step and self.loop.exit_reason is None:
            train_step(self)
        return finish(self)
