"""Metric sinks beside metrics.jsonl: TensorBoard, Weights & Biases, a Prometheus textfile.

metrics.jsonl stays the source of truth and is always written; the sinks get the same records after it.
Rank 0 of a region writes. What they carry is one set of scalars (:func:`scalars`), under the same names in
every sink (Prometheus adds its ``sbatch_gen_`` namespace):

- per step: ``loss``, ``lr``, ``tokens_per_s``, ``step_time_s``, ``data_time_s``, ``comm_time_s``,
  ``slowest_rank``, ``grad_norm``, ``mem_bytes``, ``mfu``, ``hfu``, the ``time_share_*``; on a GPU with NVML, per rank, the
  telemetry of :mod:`.telemetry` (``DCGM_FI_DEV_GPU_UTIL/rank0`` ...; Prometheus: a ``rank`` label);
- per cross-region round: its phases (``xr_upload_s`` ... ``xr_total_s``), ``xr_exposed_s``,
  ``xr_bytes_up``/``xr_bytes_down``, ``xr_participants``, ``xr_absent_regions``, ``xr_late`` (1 when this
  region was late) and ``xr_round``.

They are written outside the training process: rank 0 starts :mod:`.sinkproc`, a low-priority process
that follows metrics.jsonl and feeds :class:`Sinks` in batches, so neither a slow sink (W&B's start or
upload, a disk) nor the sinks' Python work costs the step anything but its metrics.jsonl line. A sink that
raises is logged once, with the reason, and dropped: it never stops training, and metrics.jsonl is
unaffected.

Resumed attempts continue the same runs: TensorBoard writes to the same directory with a purge at the
attempt's first step (its readers drop what an earlier attempt logged from there on; a fresh start over a
used run dir purges from step 1), W&B resumes the run of the same id and skips the steps an earlier attempt
already logged (the last step of metrics.jsonl when this attempt started), and the Prometheus file is a
snapshot, rewritten atomically.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..errors import clean_message, cut
from ..metrics_options import MetricsOptions
from .telemetry import FIELDS as GPU_FIELDS

log = logging.getLogger("sbatch_gen.train")

STEP_SCALARS = (
    "loss",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "data_time_s",
    "comm_time_s",
    "slowest_rank",
    "grad_norm",
    "mem_bytes",
    "mfu",
    "hfu",
    "time_share_fwd_bwd",
    "time_share_optimizer",
    "time_share_data",
    "time_share_comm",
    "time_share_xr",
)
ROUND_SCALARS = (
    "xr_round",
    "xr_upload_s",
    "xr_wait_s",
    "xr_download_s",
    "xr_reduce_s",
    "xr_broadcast_s",
    "xr_outer_step_s",
    "xr_cleanup_s",
    "xr_total_s",
    "xr_exposed_s",
    "xr_join_s",
    "xr_bytes_up",
    "xr_bytes_down",
)
# counted from the round's membership lists, or 0/1 from a flag
ROUND_COUNTS = {"xr_participants": "xr_members", "xr_absent_regions": "xr_absent"}
PROMETHEUS_PREFIX = "sbatch_gen_"
RANK_SEP = "/rank"  # a per-rank scalar's name: <field>/rank<R>


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    return None


def scalars(record: dict) -> tuple[int, dict[str, float]] | None:
    """(step, {name: value}) of a metrics.jsonl record, or None for a record without a step.

    A step record gives the step scalars it has (a missing or null field is left out), plus the round
    scalars when a cross-region round ended at that step; an ``xr_final_round`` event gives the round
    scalars only. Other events give None."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    event = record.get("event")
    if event is not None and event != "xr_final_round":
        return None
    out: dict[str, float] = {}
    if event is None:
        for name in STEP_SCALARS:
            if (v := _number(record.get(name))) is not None:
                out[name] = v
    if event is None:
        for name in GPU_FIELDS:  # per rank: <field>/rank<R> (Prometheus: a rank label)
            if isinstance(vals := record.get(name), list):
                for rank, x in enumerate(vals):
                    if (v := _number(x)) is not None:
                        out[f"{name}{RANK_SEP}{rank}"] = v
    if "xr_round" in record:
        for name in ROUND_SCALARS:
            if (v := _number(record.get(name))) is not None:
                out[name] = v
        for name, field in ROUND_COUNTS.items():
            if isinstance(record.get(field), list):
                out[name] = float(len(record[field]))
        if "xr_late" in record:
            out["xr_late"] = float(bool(record["xr_late"]))
    return step, out


def last_logged_step(path: Path, chunk: int = 1 << 16, end: int | None = None) -> int | None:
    """The step of the last step record in metrics.jsonl before byte ``end`` (default: the whole file;
    None: no file, or no step record), read backwards, so a two-day run's file is not read whole."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size if end is None else min(end, size)
        tail = b""
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            lines = tail.split(b"\n")
            complete = lines if start == 0 else lines[1:]  # the first may be cut
            for line in reversed(complete):
                m = re.match(rb'\{"step": (\d+),', line)
                if m:
                    return int(m.group(1))
            tail = lines[0] if start else b""
    return None


class Sink(Protocol):
    name: str

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None:
        """After a batch of writes."""

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under ``<run-dir>/tensorboard``, one event per record, flushed after every batch; written
    with the tensorboard package's own record writer, so the sinks' process never imports torch."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, first_step: int) -> None:
        # the tensorboard package, without torch nor TensorFlow
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        directory = run_dir / "tensorboard"
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard's file name (it reads the files of a directory in name order: the time first); never
        # an earlier attempt's file ("x"), whatever the pid
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{os.urandom(4).hex()}"
        earlier = any(directory.glob("events.out.tfevents.*"))
        self._file = open(directory / name, "xb")
        # written here, not through its EventFileWriter: that one hands every event to a thread of its own,
        # which costs this process more CPU per record than the write itself
        self._records = RecordWriter(self._file)
        self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if first_step > 1 or earlier:
            # a session restart at the attempt's first step: TensorBoard's readers drop what an earlier
            # attempt logged from this step on (the purge_step of torch's SummaryWriter, the same event);
            # at step 1 too when an earlier run's files are there (a fresh start over a used run dir)
            self._add(Event(step=first_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def write(self, step: int, values: dict[str, float]) -> None:
        # one event per record, its scalars in one summary: an event per scalar costs several times the CPU
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._add(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """One W&B run per region, in a group named by the run id; online when the API key's variable is set
    (or ``wandb_mode: online``), offline otherwise, its files under ``<run-dir>/wandb``."""

    name = "wandb"

    def __init__(
        self, opts: MetricsOptions, run_dir: Path, run_id: str, region: str, skip_through: int | None
    ) -> None:
        import wandb  # needs the wandb package

        key = os.environ.get(opts.wandb_api_key_env)
        mode = opts.wandb_mode
        if mode == "auto":
            mode = "online" if key else "offline"
        if key and opts.wandb_api_key_env != "WANDB_API_KEY":
            os.environ["WANDB_API_KEY"] = key  # wandb reads this one; the render never holds the key
        self.skip_through = skip_through
        self.run = wandb.init(
            project=opts.wandb_project,
            entity=opts.wandb_entity,
            group=run_id,
            name=region,
            id=_wandb_id(run_id, region),
            resume="allow",
            dir=str(run_dir),
            mode=mode,
            settings=wandb.Settings(init_timeout=opts.wandb_init_timeout_s, silent=True, console="off"),
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.skip_through is not None and step <= self.skip_through:
            return  # an earlier attempt logged it (W&B steps only move forward)
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass  # W&B's own process uploads and syncs

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_id: str, region: str) -> str:
    """A W&B run id for (run, region): W&B ids may not hold '/' and some other characters."""
    return _safe(f"{run_id}-{region}")[:128]


class PrometheusSink:
    """A node_exporter textfile-collector file, rewritten atomically after a batch that reached
    ``prometheus_every`` steps past the last rewrite (and at the end): every scalar as a gauge labelled
    with the run id and region, plus the last step and the write time."""

    name = "prometheus"

    def __init__(self, opts: MetricsOptions, run_dir: Path, run_id: str, region: str) -> None:
        import prometheus_client  # needs the prometheus-client package

        self._client = prometheus_client
        self.every = opts.prometheus_every
        directory = Path(opts.prometheus_dir) if opts.prometheus_dir else run_dir
        self.path = directory / f"sbatch_gen_{_safe(f'{run_id}_{region}')}.prom"
        self.labels = {"run_id": run_id, "region": region}
        self.values: dict[str, float] = {}
        self.step: int | None = None
        self.written: int | None = None

    def write(self, step: int, values: dict[str, float]) -> None:
        self.values.update(values)
        self.step = step

    def flush(self) -> None:
        if self.step is not None and (self.written is None or self.step - self.written >= self.every):
            self._rewrite()

    def _rewrite(self) -> None:
        c = self._client
        reg = c.CollectorRegistry()
        names = sorted(self.labels)
        gauge = {"step": self.step, "last_write_timestamp_seconds": time.time(), **self.values}
        per_rank: dict[str, Any] = {}
        for name, v in gauge.items():
            if RANK_SEP in name:  # a GPU telemetry field of one rank: one gauge, labelled by rank
                base, rank = name.split(RANK_SEP, 1)
                if base not in per_rank:
                    per_rank[base] = c.Gauge(
                        PROMETHEUS_PREFIX + base, _HELP.get(base, base), [*names, "rank"], registry=reg
                    )
                per_rank[base].labels(**self.labels, rank=rank).set(v)
                continue
            g = c.Gauge(PROMETHEUS_PREFIX + name, _HELP.get(name, name), names, registry=reg)
            g.labels(**self.labels).set(v)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        c.write_to_textfile(str(self.path), reg)  # a temp file, then a rename
        self.written = self.step

    def close(self) -> None:
        if self.step is not None and self.step != self.written:
            self._rewrite()


_HELP = {
    "step": "the last step logged",
    "last_write_timestamp_seconds": "when this file was written (Unix time)",
    "loss": "training loss, mean over the region's ranks",
    "tokens_per_s": "tokens per second, the whole region",
    "xr_exposed_s": "seconds training waited for the last cross-region round",
    "xr_participants": "regions that took part in the last round",
    "xr_absent_regions": "regions absent from the last round",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %) of the rank's GPU, read through NVML",
    "DCGM_FI_DEV_FB_USED": "framebuffer memory used (in MiB) of the rank's GPU, read through NVML",
    "DCGM_FI_DEV_POWER_USAGE": "power draw (in W) of the rank's GPU, read through NVML",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C) of the rank's GPU, read through NVML",
}


class Sinks:
    """The sinks :func:`open_sinks` started (in :mod:`.sinkproc`'s process), fed batches of metrics.jsonl
    records by :meth:`write_batch`."""

    def __init__(self, makers: dict[str, Callable[[], Sink]]) -> None:
        self.sinks: list[Sink] = []
        for name, make in makers.items():
            self._start(name, make)

    def write(self, record: dict) -> None:
        self.write_batch([record])

    def write_batch(self, records: list[dict]) -> None:
        """Every record's scalars to every sink, then one flush each."""
        got = [g for r in records if (g := scalars(r)) is not None and g[1]]
        if not got:
            return
        for sink in list(self.sinks):
            for step, values in got:
                if not self._call(sink, "write", step, values):
                    break
            self._call(sink, "flush")

    def _start(self, name: str, make: Callable[[], Sink]) -> None:
        try:
            self.sinks.append(make())
        except ImportError as e:
            log.warning(
                "metrics sink %s not started: %s (pip install 'sbatch-gen[metrics]'); metrics.jsonl is written",
                name,
                e,
            )
        except Exception as e:
            log.warning(
                "metrics sink %s not started (%s: %s); metrics.jsonl is written",
                name,
                type(e).__name__,
                _short(e),
            )

    def _call(self, sink: Sink, what: str, *args: Any) -> bool:
        """Whether ``sink`` is still on after ``sink.what(*args)``."""
        if sink not in self.sinks:
            return False
        try:
            getattr(sink, what)(*args)
            return True
        except Exception as e:  # a sink never stops training
            self.sinks.remove(sink)
            log.warning(
                "metrics sink %s failed (%s: %s): disabled; metrics.jsonl is unaffected",
                sink.name,
                type(e).__name__,
                _short(e),
            )
            return False

    def close(self) -> None:
        """Close every sink (W&B's finish uploads what is left online)."""
        for sink in list(self.sinks):
            self._call(sink, "close")


def _short(e: BaseException) -> str:
    """An exception as one line for the warning: the project's message cleaning (credentials masked,
    control characters escaped), cut to 200 characters."""
    return cut(clean_message(str(e)), 200)


def _safe(name: str) -> str:
    """``name`` with what W&B ids and file names may not hold replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def open_sinks(
    opts: MetricsOptions,
    run_dir: Path,
    *,
    run_id: str,
    region: str,
    first_step: int,
    start: int | None = None,
) -> Sinks | None:
    """The sinks ``opts`` turns on, for rank 0 of a region whose attempt logs from ``first_step`` on, from
    byte ``start`` of metrics.jsonl (default: its end now); None when none is. One that cannot start (its
    package missing, W&B unreachable) is logged once and left out."""
    if not opts.sinks:
        return None
    # the last step an earlier attempt logged: before this attempt's first record
    skip = last_logged_step(run_dir / "metrics.jsonl", end=start)
    makers: dict[str, Callable[[], Sink]] = {
        "tensorboard": lambda: TensorBoardSink(run_dir, first_step),
        "wandb": lambda: WandbSink(opts, run_dir, run_id, region, skip),
        "prometheus": lambda: PrometheusSink(opts, run_dir, run_id, region),
    }
    return Sinks({name: makers[name] for name in opts.sinks})
