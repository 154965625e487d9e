"""Helpers for the SSH launcher tests: a real sshd on 127.0.0.1, rendering ssh-local for a test, and
watching the launcher and the processes it tagged (/proc/<pid>/environ, as the launcher's cleanup does)."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sbatch_gen.testing.s3server import free_port
from sbatch_gen.testing.ssh_launcher import ssh_launcher_functions

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    """A running sshd: connect with ``ssh_argv()``; ``proxy`` is a ProxyCommand when it lives in another
    network namespace."""

    port: int
    user: str
    identity: Path
    known_hosts: Path
    log: Path
    proc: subprocess.Popen
    proxy: str | None = None

    def options(self) -> list[str]:
        """ssh -o options for the launcher's profile (ssh.options)."""
        opts = ["StrictHostKeyChecking=yes", f"UserKnownHostsFile={self.known_hosts}"]
        if self.proxy:
            opts.append(f"ProxyCommand={self.proxy}")
        return opts

    def ssh_argv(self, host: str = "127.0.0.1") -> list[str]:
        argv = [
            "ssh",
            "-p",
            str(self.port),
            "-l",
            self.user,
            "-i",
            str(self.identity),
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
        ]
        for o in self.options():
            argv += ["-o", o]
        return [*argv, host]


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sbatch-gen-test", "-f", str(path)], check=True
    )


# ssh ProxyCommand body: relay stdin/stdout to 127.0.0.1:PORT (run inside sshd's network namespace),
# passing the end of input on as a TCP half-close so both sides see the session end.
_RELAY = """import socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while True:
        b = sys.stdin.buffer.read1(65536)
        if not b:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(b)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    sys.stdout.buffer.write(b)
    sys.stdout.buffer.flush()
"""


def start_sshd(
    d: Path,
    names: tuple[str, ...] = ("127.0.0.1", "localhost"),
    wrap: tuple[str, ...] = (),
    setup: str = "",
    netns: bool = False,
    port: int | None = None,
) -> Sshd:
    """Start ``sshd -D`` on 127.0.0.1 at a free port with keys generated in ``d``.

    ``wrap`` prefixes the command (e.g. ``unshare --mount``), ``setup`` runs first in that shell (then
    sshd is exec'd, so the PID is sshd's). With ``netns`` sshd is in its own network namespace and is
    reached through a ProxyCommand that enters it. ``names``: host names pinned in known_hosts.
    """
    if not (os.path.exists(SSHD) and shutil.which("ssh")):
        raise AssertionError(
            "openssh-server and openssh-client are required (make system-deps installs them)"
        )
    d.mkdir(parents=True, exist_ok=True)
    d = d.resolve()  # sshd re-executes itself from / for every connection
    if not (d / "hostkey").exists():
        _keygen(d / "hostkey")
        _keygen(d / "id_ed25519")
        shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
        (d / "authorized_keys").chmod(0o600)
    os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory sshd insists on
    key_type, key = (d / "hostkey.pub").read_text().split()[:2]
    log = d / "sshd.log"
    fixed = port
    for _ in range(1 if fixed else 5):  # a free port can be taken between probing and binding: retry
        port = fixed or free_port()
        known = d / "known_hosts"
        known.write_text("".join(f"[{h}]:{port} {key_type} {key}\n" for h in names))
        sshd_argv = [
            SSHD,
            "-D",
            "-p",
            str(port),
            "-h",
            str(d / "hostkey"),
            "-o",
            "ListenAddress=127.0.0.1",
            "-o",
            f"AuthorizedKeysFile={d / 'authorized_keys'}",
            "-o",
            "StrictModes=no",
            "-o",
            f"PidFile={d / 'sshd.pid'}",
            "-o",
            "MaxStartups=64:30:128",
            "-o",
            "MaxSessions=64",
            "-E",
            str(log),
        ]
        if wrap or setup:
            cmd = [*wrap, "bash", "-c", f'{setup or ":"}; exec "$@"', "sshd-wrap", *sshd_argv]
        else:
            cmd = sshd_argv
        proc = subprocess.Popen(cmd)
        proxy = None
        if netns:
            relay = d / "relay.py"
            relay.write_text(_RELAY)
            proxy = f"nsenter --net=/proc/{proc.pid}/ns/net {sys.executable} {relay} %p"
        server = Sshd(port, getpass.getuser(), d / "id_ed25519", known, log, proc, proxy)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                r = subprocess.run([*server.ssh_argv(names[-1]), "true"], capture_output=True, timeout=30)
                if r.returncode == 0:
                    return server
                time.sleep(0.2)
        except BaseException:
            stop_sshd(server)
            raise
        stop_sshd(server)
    raise AssertionError(f"sshd did not start: {log.read_text() if log.exists() else ''}")


def stop_sshd(server: Sshd) -> None:
    """Stop sshd by its own PID (sessions it started keep running: the tests clean those up by tag)."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


# ---------------------------------------------------------------------------------------------------
# Launching rendered launchers against that sshd

SITE = "ssh-local"


def tagged_pids(tag: str) -> list[int]:
    """PIDs of the processes whose environment holds SBATCH_GEN_TAG=<tag> (what the launcher's cleanup
    looks for), read the same way: /proc/<pid>/environ."""
    want = f"SBATCH_GEN_TAG={tag}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if want in env.split(b"\0"):
            out.append(int(d.name))
    return sorted(out)


def pids_with_env(tag: str, **env: str) -> list[int]:
    """Tagged PIDs whose environment also holds every KEY=VALUE in ``env``."""
    out = []
    for pid in tagged_pids(tag):
        try:
            items = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if all(f"{k}={v}".encode() in items for k, v in env.items()):
            out.append(pid)
    return out


@dataclass
class Launch:
    proc: subprocess.Popen
    dir: Path
    script: Path
    tag: str
    out_file: Path

    @property
    def run_dir(self) -> Path:
        return self.dir / "runs" / SITE

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs" / f"{SITE}.{self.tag}"

    def output(self) -> str:
        return self.out_file.read_text(errors="replace")

    def exits(self) -> list[tuple[int, int, str, int]]:
        f = self.logs / "exits.tsv"
        if not f.exists():
            return []
        rows = [line.split("\t") for line in f.read_text().splitlines()]
        return [(int(a), int(r), h, int(rc)) for a, r, h, rc in rows]

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout}s:\n{self.output()}") from None

    def metrics_steps(self) -> list[int]:
        f = self.run_dir / "metrics.jsonl"
        if not f.exists():
            return []
        steps = []
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                steps.append(int(json.loads(line)["step"]))
        return steps

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metrics_steps() and max(self.metrics_steps()) >= step:
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"launcher exited ({self.proc.returncode}) before step {step}:\n{self.output()}"
                )
            time.sleep(0.2)
        raise AssertionError(f"no step {step} within {timeout}s:\n{self.output()}")

    def node_log(self, attempt: int, rank: int) -> str:
        (f,) = self.logs.glob(f"attempt-{attempt}.node-{rank}.*.log")
        return f.read_text(errors="replace")


def render_site(repo: Path, out_dir: Path, overrides: list[str], site: str = SITE) -> Path:
    argv = [str(repo / ".venv" / "bin" / "sbatch-gen"), "render", "--site", site, "--out", str(out_dir)]
    for o in overrides:
        argv += ["--set", o]
    r = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out_dir / f"{site}.sh"


def tiny_config(path: Path, **train) -> Path:
    """configs/tiny.yaml with train.* overrides, written to ``path``."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml").read_text())
    for k, v in train.items():
        section, key = k.split("__")
        cfg[section][key] = v
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def base_overrides(repo: Path, sshd: Sshd, data_dir: Path, config: Path, rdzv_port: int) -> list[str]:
    """ssh-local with this test's sshd, the checkout's venv and code, and short timings."""
    return [
        f"ssh.port={sshd.port}",
        f"ssh.identity_file={sshd.identity}",
        "ssh.options=" + json.dumps(sshd.options()),
        f"python_env.path={repo / '.venv'}",
        f"paths.code_dir={repo}",
        f"paths.data={data_dir}",
        f"trainer.config={config}",
        f"torchrun.rdzv_port={rdzv_port}",
        "launch.cooldown_s=1",
        "launch.kill_grace_s=8",
        "launch.failure_grace_s=20",
    ]


# ---------------------------------------------------------------------------------------------------
# A probe in place of torchrun, for tests about what reaches each node (no torch, fast)

PROBE = """#!{python}
# Stands in for torchrun: records its argv, environment and directory on each node, then by
# SBG_PROBE_MODE (profile extra_env): exit (default) exits 0; run counts beats in probe/node-R.beats
# until killed; hang ignores SIGTERM and sleeps, like a stuck worker.
import json, os, signal, sys, time
rank = os.environ["SBATCH_GEN_NODE_RANK"]
mode = os.environ.get("SBG_PROBE_MODE", "exit")
if mode == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.makedirs("probe", exist_ok=True)
with open(f"probe/node-{{rank}}.json.tmp", "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}}, f)
os.replace(f"probe/node-{{rank}}.json.tmp", f"probe/node-{{rank}}.json")
beats = 0
while mode != "exit":
    time.sleep(0.2)
    beats += 1
    with open(f"probe/node-{{rank}}.beats", "w") as f:
        f.write(str(beats))
"""


def probe_venv(d: Path) -> Path:
    """A venv whose python (and site-packages) are the project's and whose torchrun is PROBE."""
    venv = Path(__file__).resolve().parents[2] / ".venv"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").symlink_to(venv / "bin" / "python")
    (d / "lib").symlink_to(venv / "lib")
    shutil.copy(venv / "pyvenv.cfg", d / "pyvenv.cfg")
    torchrun = d / "bin" / "torchrun"
    torchrun.write_text(PROBE.format(python=venv / "bin" / "python"))
    torchrun.chmod(0o755)
    return d


def main(argv: list[str] | None = None) -> int:
    """Serve sites/ssh-local.yaml by hand: ``python tests/ssh/sshkit.py`` (as root, from the checkout) starts
    an sshd on 127.0.0.1:2222 with keys in .state/ssh/ (what the profile names); Ctrl-C stops it."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument(
        "--dir", default=".state/ssh", help="keys, known_hosts and the sshd log (default .state/ssh)"
    )
    ap.add_argument(
        "--port", type=int, default=2222, help="port on 127.0.0.1 (default 2222, as in sites/ssh-local.yaml)"
    )
    args = ap.parse_args(argv)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    server = start_sshd(Path(args.dir), port=args.port)
    print(
        f"sshd {server.proc.pid} on 127.0.0.1:{server.port}, keys in {args.dir}; "
        "in another shell: bash out/ssh-local.sh; Ctrl-C here stops sshd",
        flush=True,
    )
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_sshd(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


REPO = Path(__file__).resolve().parents[2]


def launcher_lib(tmp_path: Path, port: int, *overrides: str) -> Path:
    """The ssh-local launcher rendered for this checkout (its venv, code, tiny config, run and log dirs under
    ``tmp_path``, rendezvous ``port``) without its last line (``main "$@"``): a library of its functions."""
    script = render_site(
        REPO,
        tmp_path / "out",
        [
            f"python_env.path={REPO / '.venv'}",
            f"paths.code_dir={REPO}",
            f"trainer.config={REPO / 'configs' / 'tiny.yaml'}",
            f"paths.run_dir={tmp_path / 'run'}",
            f"paths.log_dir={tmp_path / 'logs'}",
            f"torchrun.rdzv_port={port}",
            *overrides,
        ],
    )
    lib = tmp_path / "launcher-lib.sh"
    lib.write_text(ssh_launcher_functions(script))
    return lib


def run_lib(lib: Path, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` under bash after sourcing the launcher library ``lib``, from the checkout, with this
    environment minus what a Slurm job or an outer launch would have set (``env``: that environment instead)."""
    if env is None:
        env = scrubbed_env()
    return subprocess.run(
        ["bash", "-c", f'source "$1"\n{code}', "launcher", str(lib)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def scrubbed_env() -> dict[str, str]:
    """This process's environment without SLURM* and SBATCH_GEN* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SBATCH_GEN"))}
