"""Fixtures for the trainer's tests: a prepared data shard, tiny configs, torchrun launches."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def write_config(path: Path, **sections) -> Path:
    """configs/tiny.yaml with ``section={key: value}`` overrides merged in."""
    cfg = yaml.safe_load(TINY.read_text())
    for sec, vals in sections.items():
        if isinstance(vals, dict):
            cfg.setdefault(sec, {}).update(vals)
        else:
            cfg[sec] = vals
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Step records of metrics.jsonl; a step logged twice (re-run after a crash) keeps the last one."""
    out = {}
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "step" in rec and "loss" in rec:
            out[rec["step"]] = rec
    return out


def same_weights(a: Path, b: Path) -> bool:
    """Bitwise-equal tensors in two model.safetensors exports (whatever their metadata)."""
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype
        and ta[k].shape == tb[k].shape
        and torch.equal(ta[k].contiguous().view(torch.uint8), tb[k].contiguous().view(torch.uint8))
        for k in ta
    )


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir).items()}


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """In-process runs share 2 busy cores with other tests: oversubscribed OpenMP threads are slow."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One prepared shard (region 'local') shared by every test: 300 kB of the Python stdlib."""
    from sbatch_gen.train.data import prepare

    d = tmp_path_factory.mktemp("data")
    prepare(d, ["local"], source="python-stdlib", max_bytes=300_000)
    return d


@pytest.fixture(scope="module")
def example_data(tmp_path_factory) -> Path:
    """A directory of text files (the script reads every file under it): a copy, so that an edit to the
    docs while the tests run changes nothing."""
    d = tmp_path_factory.mktemp("plain-data")
    for p in sorted((REPO / "docs").glob("*.md"))[:3]:
        shutil.copy(p, d / p.name)
    return d


def train_env(extra: dict | None = None, restarts: bool = False) -> dict:
    """The environment of a trainer or torchrun the tests start: this one's, less a launcher's variables.
    ``restarts``: torchrun may restart its workers (see below)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "SBATCH_GEN_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
        )
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    # torchrun's shared rendezvous store keeps the previous attempt's keys: restarted workers can read
    # a dead peer's address (pytorch#135712). A fresh store per attempt avoids it, as in the rendered scripts,
    # and, as there, only where torchrun may restart: a fresh store is rank 0's own, on a port the agent found
    # free and closed again, which another process can take meanwhile (a make test run lost a launch to
    # EADDRINUSE so); the shared one is the agent's, already bound.
    if restarts:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra or {})
    return env


def torchrun_cmd(
    config: Path,
    run_dir: Path,
    data: Path,
    *extra: str,
    nproc: int = 2,
    max_restarts: int = 0,
    module: str = "sbatch_gen.train",
) -> list[str]:
    """torchrun of ``module`` (``sbatch_gen.testing.faults``: the trainer with the environment's faults, such
    as a per-step sleep, installed)."""
    return [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        "-m",
        module,
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--data-path",
        str(data),
        *extra,
    ]


def max_restarts(cmd: list[str]) -> int:
    """torchrun's --max-restarts in ``cmd`` (0 when not given)."""
    for i, word in enumerate(cmd):
        if word == "--max-restarts" and i + 1 < len(cmd):
            return int(cmd[i + 1])
        if word.startswith("--max-restarts="):
            return int(word.split("=", 1)[1])
    return 0


class Launch:
    """A torchrun process group (own session, so the test can clean it up) logging to a file."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=train_env(env, restarts=max_restarts(cmd) > 0),
            start_new_session=True,
        )

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the trainer processes torchrun started (its direct children)."""
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                env = (d / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            for kv in env:
                if kv.startswith(b"RANK="):
                    out[int(kv[5:])] = int(d.name)
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            # torchrun starts each worker in its own session: kill them by pid, then torchrun's group.
            for pid in self.workers().values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        if not self._fh.closed:
            self._fh.close()


@pytest.fixture
def launches():
    started: list[Launch] = []

    def start(cmd, log, env=None) -> Launch:
        la = Launch(cmd, log, env)
        started.append(la)
        return la

    yield start
    for la in started:
        la.kill()


def wait_for(pred, timeout: float, what: str, proc: Launch | None = None, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(
                f"torchrun exited ({proc.proc.returncode}) before {what}:\n{proc.output()[-4000:]}"
            )
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
