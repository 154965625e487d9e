"""Run several regions of one cross-region job on this machine: each region is its own torchrun (its own
rendezvous port, its own process group) running ``python -m sbatch_gen.train``; they meet only in the
mailbox. Used by the tests, ``make demo`` and the benchmarks. Torch-free. With ``stop_file`` each node's
torchrun runs under the node program's run-trainer, as the launchers run it (the stop file, a crash's leave).

Processes are tracked by PID: :meth:`RegionRun.kill` SIGKILLs the processes it started and everything below
them (torchrun's agents and their workers, which torchrun starts in sessions of their own), never anything
found by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sbatch_gen import node_program
from sbatch_gen.contract import ENV_STOP_FILE, EXIT_REQUEUE
from sbatch_gen.proc import children, descendants, process_state
from sbatch_gen.xr_options import CrossRegion, to_argv

from .faults import trainer_module
from .s3server import free_port

_SCRUB = ("SLURM_", "TORCHELASTIC_", "SBATCH_GEN_")
_SCRUB_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB) and k not in _SCRUB_NAMES}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _is_run_trainer(pid: int) -> bool:
    """Whether ``pid`` runs the node program's run-trainer (its command line, from /proc)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"run-trainer" in argv and any(a.endswith(b"node_program.py") for a in argv)


@dataclass
class RegionRun:
    region: str
    run_dir: Path
    procs: list[subprocess.Popen]
    logs: list[Path]
    cmd: list[str] = field(default_factory=list)

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        rcs = []
        for p in self.procs:
            try:
                rcs.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(
                    f"region {self.region} did not finish in {timeout:g} s; log:\n{self.tail()}"
                ) from None
        return rcs

    def worker_pids(self) -> list[int]:
        return [c for p in self.procs if p.poll() is None for c in children(p.pid)]

    def kill(self) -> None:
        """SIGKILL the agents and their workers, and run-trainer around them (a crash, as far as the other
        region can tell)."""
        workers = [d for p in self.procs if p.poll() is None for d in descendants(p.pid)]
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(process_state(w) not in ("Z", "X") for w in workers):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def kill_trainer(self) -> None:
        """SIGKILL what run-trainer runs (torchrun's agents and their workers) and leave run-trainer itself: the
        training processes crash, the job's step lives on, as when a worker dies on a node (an error, the OOM
        killer), and run-trainer announces the region's leave. A region started without run-trainer (no
        ``stop_file``) has nothing that outlives its trainer: :meth:`kill`."""
        tree = [p.pid for p in self.procs if p.poll() is None]
        tree += [d for pid in tree for d in descendants(pid)]
        supervisors = [pid for pid in tree if _is_run_trainer(pid)]
        if not supervisors:
            self.kill()
            return
        victims = [d for s in supervisors for d in descendants(s)]
        for v in victims:
            try:
                os.kill(v, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while any(process_state(v) not in ("Z", "X") for v in victims):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def tail(self, n: int = 60) -> str:
        out = []
        for log in self.logs:
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"--- {log} ---\n" + "\n".join(lines[-n:]))
        return "\n".join(out)


def launch_region(
    xr: CrossRegion,
    *,
    config: str | os.PathLike,
    run_dir: str | os.PathLike,
    data_path: str | os.PathLike | None = None,
    nproc: int = 2,
    nnodes: int = 1,
    max_steps: int | None = None,
    resume: str = "auto",
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    extra_args: list[str] | None = None,
    python: str = sys.executable,
    module: str | None = None,
    stop_file: str | os.PathLike | None = None,
) -> RegionRun:
    """Start one region: ``nnodes`` torchrun agents (a multi-node job on one machine) of ``nproc``
    workers each, sharing a fresh c10d rendezvous port. ``module``: what each worker runs with the
    trainer's arguments (default: :func:`~sbatch_gen.testing.faults.trainer_module` of ``env``,
    ``sbatch_gen.testing.faults`` when it names a fault or a per-step sleep). ``stop_file``:
    each agent runs under the node program's run-trainer with that stop file (the trainer's
    ``SBATCH_GEN_STOP_FILE``) and the requeue code as its stopped status, node N with
    ``SBATCH_GEN_NODE_RANK=N`` as the SSH launcher runs it: a crash announces the region's leave."""
    run_dir = Path(run_dir)
    log_dir = Path(log_dir) if log_dir else run_dir.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    train = [
        "-m",
        module or trainer_module(env),
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--resume",
        resume,
    ]
    if data_path is not None:
        train += ["--data-path", str(data_path)]
    if max_steps is not None:
        train += ["--max-steps", str(max_steps)]
    train += to_argv(xr) + list(extra_args or [])
    procs, logs = [], []
    for node in range(nnodes):
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={xr.region}",
            "--max-restarts=0",
            *train,
        ]
        node_env = dict(env or {})
        if stop_file is not None:
            supervise = [python, "-I", str(Path(node_program.__file__)), "run-trainer"]
            supervise += ["--stop-file", str(stop_file), "--stopped-rc", str(EXIT_REQUEUE), "--"]
            cmd = [*supervise, *cmd]
            node_env.update({ENV_STOP_FILE: str(stop_file), "SBATCH_GEN_NODE_RANK": str(node)})
        log = log_dir / (f"{xr.region}.log" if nnodes == 1 else f"{xr.region}.node{node}.log")
        with open(log, "ab") as f:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=clean_env(node_env), start_new_session=True
                )
            )
        logs.append(log)
    return RegionRun(xr.region, run_dir, procs, logs, cmd)
