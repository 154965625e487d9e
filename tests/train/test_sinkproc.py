"""The metric sinks' process (sbatch_gen/train/sinkproc.py) on its own: it imports no torch, a stop signal
while it starts does not kill it, it has a deadline once its trainer ended (W&B still starting), and two
attempts' processes never write the same sinks at once (the run dir's lock)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.proc import descendants
from sbatch_gen.train.sinkproc import (
    LOCK_FILE,
    NICE,
    SinkProcess,
    Tail,
    Watch,
    leave_low_priority,
)

from .conftest import wait_for
from .readback import prometheus_samples, tensorboard_scalars

pytestmark = pytest.mark.slow  # starts the sinks' process (imports tensorboard, wandb)


def _start(run_dir: Path, sinks: list[str], **kw) -> SinkProcess:
    """The sinks' process for the records appended to ``run_dir``/metrics.jsonl from now on."""
    path = run_dir / "metrics.jsonl"
    path.touch()
    opts = MetricsOptions(sinks=sinks, prometheus_every=1, wandb_init_timeout_s=300)
    return SinkProcess(
        opts, path, run_id="r", region="eu", first_step=1, start=path.stat().st_size, poll_s=0.1, **kw
    )


def _append(run_dir: Path, *steps: int) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in steps)


def _prom_step(run_dir: Path) -> float | None:
    try:
        return prometheus_samples(run_dir / "sbatch_gen_r_eu.prom")["sbatch_gen_step"][1]
    except (FileNotFoundError, KeyError):
        return None


class _Log:
    """The lines the sinks' processes wrote to this process's stderr (capfd), kept across reads."""

    def __init__(self, capfd) -> None:
        self.capfd = capfd
        self.lines: list[str] = []

    def __call__(self) -> list[str]:
        self.lines += [ln.split("] ", 1)[1] for ln in self.capfd.readouterr().err.splitlines() if "] " in ln]
        return self.lines

    def has(self, text: str) -> bool:
        return any(text in line for line in self())


def test_the_sinks_process_never_imports_torch(tmp_path, monkeypatch, capfd):
    """torch made unimportable (and every attempt to import it recorded): TensorBoard is still written, and
    reads back with TensorBoard's reader."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    tried = tmp_path / "torch-import-tried"
    (fake / "torch" / "__init__.py").write_text(
        f"open({str(tried)!r}, 'a').write('tried\\n')\nraise ImportError('torch is not importable in this test')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(fake))  # before site-packages, after the package's own root
    run = tmp_path / "run"
    run.mkdir()
    proc = _start(run, ["tensorboard"])
    _append(run, 1, 2, 3)
    assert proc.close(60) and proc.proc.returncode == 0
    assert not tried.exists()
    assert tensorboard_scalars(run)["loss"] == {1: 1.0, 2: 2.0, 3: 3.0}
    assert [line for line in _Log(capfd)() if "metrics sink" in line and "started in" not in line] == []


def test_the_sinks_process_runs_in_the_idle_scheduling_class_below_the_trainer(tmp_path):
    """SCHED_IDLE: it never keeps a trainer thread waiting for a CPU (nice +10 as well, where that is all
    that is allowed)."""
    proc = _start(tmp_path, ["prometheus"])
    try:
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE or _wait_idle(proc.pid)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    finally:
        assert proc.close(60) and proc.proc.returncode == 0


def _wait_idle(pid: int) -> bool:
    """The process sets its class as it starts: wait for it (up to 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.sched_getscheduler(pid) == os.SCHED_IDLE:
            return True
        time.sleep(0.05)
    return False


def test_a_stop_signal_while_the_sinks_process_starts_does_not_kill_it(tmp_path):
    """Slurm signals every process of the step: one that reaches the sinks' process before it set its
    handlers (here: right after the spawn, long before Python has started) is blocked, then dropped."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    proc = _start(tmp_path, ["prometheus"])
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # the trainer's mask is back
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(proc.pid, sig)
    _append(tmp_path, 1, 2)
    assert proc.close(60) and proc.proc.returncode == 0
    assert _prom_step(tmp_path) == 2


@pytest.fixture
def wandb_hangs(monkeypatch):
    """W&B online against a server that accepts connections and never answers: wandb.init waits (its
    init timeout, 300 s here)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{sock.getsockname()[1]}")
        yield


def test_the_sinks_process_has_a_deadline_once_its_trainer_ended(tmp_path, wandb_hangs, capfd):
    """Its trainer gone (the pipe closed, as at a SIGKILL) while W&B still starts: it exits at its deadline,
    saying what it was still doing, instead of waiting out W&B's init timeout."""
    log = _Log(capfd)
    proc = _start(tmp_path, ["wandb"], deadline_s=2)
    wait_for(lambda: (tmp_path / "wandb").exists(), 60, "W&B's start")
    t0 = time.monotonic()
    assert proc.close(60), "still running after 60 s"
    assert time.monotonic() - t0 < 30 and proc.proc.returncode == 1
    assert log.has(
        "metrics sinks: still starting the sinks 2 s after the trainer ended: exiting; the last records may "
        "be missing from them (metrics.jsonl is complete)"
    ), log.lines


def test_two_attempts_sinks_processes_never_write_at_once(tmp_path, wandb_hangs, capfd, monkeypatch):
    """An old attempt's sinks' process still busy (W&B still starting: it holds the run dir's lock): a new
    one that waits too briefly leaves its sinks off, in one line; one that waits longer starts its sinks
    once the old one ended (its deadline), and writes the new attempt's records."""
    log = _Log(capfd)
    old = _start(tmp_path, ["wandb"], deadline_s=3)
    wait_for(lambda: (tmp_path / "wandb").exists(), 60, "W&B's start: it holds the lock")
    assert (tmp_path / LOCK_FILE).read_text() == f"{old.pid}\n"
    monkeypatch.delenv("WANDB_BASE_URL")  # the new attempt writes Prometheus only
    brief = _start(tmp_path, ["prometheus"], lock_wait_s=1)
    _append(tmp_path, 1)
    assert brief.close(60) and brief.proc.returncode == 0
    waiting = (
        f"metrics sinks: an earlier attempt's sinks' process (pid {old.pid}) still writes to this run's sinks "
        f"({tmp_path / LOCK_FILE}): waiting up to "
    )
    assert [line for line in log() if line.startswith("metrics sinks")] == [
        waiting + "1 s for it to finish",
        f"metrics sinks: {tmp_path / LOCK_FILE} still held after 1 s: this attempt's sinks stay off "
        "(metrics.jsonl is written; the sinks may lack this attempt's steps)",
    ]
    assert _prom_step(tmp_path) is None
    new = _start(tmp_path, ["prometheus"], lock_wait_s=60)
    wait_for(lambda: log.has(waiting + "60 s"), 60, "the waiting line")
    _append(tmp_path, 2, 3)
    time.sleep(0.5)
    assert _prom_step(tmp_path) is None  # waits for the old one
    assert old.proc.poll() is None
    old.proc.stdin.close()  # the old attempt's trainer is gone: its sinks' process ends at its deadline
    wait_for(lambda: _prom_step(tmp_path) == 3, 60, "the new attempt's records")
    assert old.proc.wait(10) == 1  # at its deadline (its line comes before the new one started: below)
    assert new.close(60) and new.proc.returncode == 0
    lines = log()
    assert lines.index(next(ln for ln in lines if "still starting the sinks 3 s" in ln)) < lines.index(
        next(ln for ln in lines if ln.startswith("metrics sinks prometheus started in"))
    )


def test_the_sinks_process_reads_what_its_trainer_wrote_before_it_ended(tmp_path):
    """Records appended after its trainer ended are a later attempt's: its own sinks' process feeds them."""
    r, w = os.pipe()
    path = tmp_path / "metrics.jsonl"
    _append(tmp_path, 1)
    tail = Tail(path, 0)
    watch = Watch(path, os.getppid(), deadline_s=24 * 3600.0, poll_s=0.1, fd=r)
    _append(tmp_path, 2)
    os.close(w)  # the trainer ended
    assert watch.ended.wait(30)
    _append(tmp_path, 3)  # a requeued attempt
    assert [rec["step"] for rec in tail.read(watch.end)] == [1, 2]
    os.close(r)


def _privileged_nice(nice: int) -> bool:
    """Whether Linux lets this user raise a process to niceness ``nice`` (and out of SCHED_IDLE)."""
    import resource

    return os.geteuid() == 0 or 20 - nice <= resource.getrlimit(resource.RLIMIT_NICE)[0]


def test_the_sinks_process_leaves_the_idle_class_once_its_trainer_ended(tmp_path):
    """At the trainer's end nothing is left to yield to: the sinks' process and the processes it started
    (W&B's service) go back to the normal class and the trainer's niceness, where Linux allows it: on a busy
    machine the idle class could starve the last records past the deadline."""

    def low() -> None:
        os.nice(NICE)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    base = os.getpriority(os.PRIO_PROCESS, 0)
    # a process (standing for the sinks' one) with a child (W&B's service), both idle and niced
    proc = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], preexec_fn=low)
    try:
        wait_for(lambda: len(descendants(proc.pid)) == 1, 30, "bash started its child")
        tids = [int(t) for pid in [proc.pid, *descendants(proc.pid)] for t in os.listdir(f"/proc/{pid}/task")]
        assert {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids} == {
            (os.SCHED_IDLE, base + NICE)
        }
        allowed = _privileged_nice(base)
        assert leave_low_priority(proc.pid, base) is allowed
        want = (os.SCHED_OTHER, base) if allowed else (os.SCHED_IDLE, base + NICE)
        assert {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids} == {want}
    finally:
        for pid in reversed(
            [proc.pid, *descendants(proc.pid)]
        ):  # the child first: orphaned, it would outlive the test
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_process_tree_is_walked_with_and_without_the_kernels_children_lists(monkeypatch):
    """sbatch_gen.proc.descendants, which the sinks' process raises back from the idle class: from
    /proc/PID/task/*/children, and on a kernel without them (CONFIG_PROC_CHILDREN) from every /proc/N/stat."""
    import builtins

    from sbatch_gen import proc as procmod

    p = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        wait_for(lambda: len(descendants(p.pid)) == 2, 30, "bash started its children")
        kids = sorted(descendants(p.pid))

        def no_children_lists(path, *a, **kw):
            if str(path).endswith("/children"):
                raise FileNotFoundError(path)
            return builtins.open(path, *a, **kw)

        monkeypatch.setattr(procmod, "open", no_children_lists, raising=False)
        assert sorted(descendants(p.pid)) == kids
    finally:
        for pid in [*descendants(p.pid), p.pid]:
            os.kill(pid, signal.SIGKILL)
        p.wait()
