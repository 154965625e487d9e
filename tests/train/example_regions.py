"""What the tests of the example trainers share (examples/train_plain.py, examples/train_fsdp.py; the data
they read is conftest's ``example_data``): a region as its own ``torchrun --standalone --nproc-per-node 2``
of an example script (CPU, gloo), meeting the others only in an fs mailbox, and the bitwise comparison of
two final.pt files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sbatch_gen.contract import ENV_STOP_FILE
from sbatch_gen.testing.regions import clean_env
from sbatch_gen.xr_options import CrossRegion, FsTransport, to_argv

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TIMEOUT = 240  # per region run: the 2 cores are shared


class Region:
    """One region: a torchrun of 2 workers running the example ``script`` (``steps`` steps, an outer round
    every ``h``, or gradients averaged every step with ``sync="grad"``, a checkpoint every ``save_every``),
    its output appended to ``<root>/<name>.log``."""

    def __init__(
        self,
        root: Path,
        name: str,
        data: Path,
        script: Path,
        steps: int,
        h: int,
        save_every: int,
        sync="diloco",
    ):
        self.root, self.name, self.data, self.script = root, name, data, script
        self.steps, self.h, self.save_every, self.sync = steps, h, save_every, sync
        self.run_dir = root / name
        self.log = root / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, stop_file: Path | None = None, timeout_s: float = 120) -> None:
        xr = CrossRegion(
            enabled=True,
            run_id="plain",
            region=self.name,
            regions=["a", "b"],
            inner_steps=self.h,
            sync=self.sync,
            timeout_s=timeout_s,
            transport=FsTransport(root=str(self.root / "mailbox")),
            **({"keep_rounds": self.steps + 1} if self.sync == "grad" else {}),  # grad: a round every step
        )
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(self.script)]
        cmd += ["--run-dir", str(self.run_dir), "--data", str(self.data), "--steps", str(self.steps)]
        cmd += ["--save-every", str(self.save_every), *to_argv(xr)]
        env = clean_env({ENV_STOP_FILE: str(stop_file)} if stop_file else None)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.root, start_new_session=True
            )

    def wait(self, timeout: float = TIMEOUT) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"region {self.name} still runs after {timeout} s:\n{self.tail()}") from None

    def workers(self) -> list[int]:
        """The worker processes torchrun started (in sessions of their own)."""
        assert self.proc is not None
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                pids += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
        return pids

    def signal_workers(self, sig: signal.Signals) -> None:
        for pid in self.workers():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal_workers(signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(timeout=30)

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.log} ---\n" + "\n".join(lines[-n:])

    def final(self) -> bytes:
        return (self.run_dir / "final.pt").read_bytes()


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    sa, sb = (torch.load(p, weights_only=True) for p in (a, b))
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8))]
    assert not differ, f"{a} and {b} differ in {differ}"
