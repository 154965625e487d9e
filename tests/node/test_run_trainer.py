"""The node program's run-trainer: the training step's supervision on one node (torchrun with SIGTERM
ignored; a SIGTERM to the supervisor is the stop request, the stop file first, then SIGTERM to torchrun's
workers; the wait until torchrun has exited; the node's one line on what the stop left; the exit status).

Real processes, no mocks: the program runs from a copy as the nodes run it (`python -I -S
sbatch-gen-node.py run-trainer ...`), around a stand-in for torchrun (a python process that starts one
worker, a python process with a SIGTERM handler, and exits with the worker's status). What the launchers do
with it runs in tests/ssh (a real sshd) and tests/e2e (a real Slurm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sbatch_gen import contract
from sbatch_gen import node_program as np

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "sbatch_gen" / "node_program.py"
NODE = "n7"
LOG_LINE = r"[sbatch-gen 2026-12-06T10:00:00Z] "  # the shape of a log line; its time varies

# torchrun's stand-in: notes whether it runs with SIGTERM ignored, starts the worker (which gets the default
# disposition back, as a real worker installs its own handler), and exits with the worker's status.
TORCHRUN = textwrap.dedent(
    """\
    import os, signal, subprocess, sys
    d = sys.argv[1]
    ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    open(os.path.join(d, "torchrun.sigterm"), "w").write("ignored" if ignored else "not ignored")
    worker = subprocess.Popen(
        [sys.executable, os.path.join(d, "worker.py"), *sys.argv[1:]],
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    sys.exit(worker.wait())
    """
)

# The worker: on SIGTERM notes what the stop file held at that moment (worker.term), then by its mode:
# "ack": writes the ack as the trainer does and exits 0; "exit": exits 3 without an ack; "hold": goes on
# until the file "release" exists, then exits 5. It says it is ready in worker.ready.
WORKER = textwrap.dedent(
    """\
    import json, os, signal, stat, sys, time
    d, mode, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    got = []

    def on_term(signum, frame):
        try:
            if stat.S_ISFIFO(os.stat(stop).st_mode):
                held = "a fifo"
            else:
                with open(stop) as f:
                    held = f.read()
        except OSError as e:
            held = "no stop file: " + type(e).__name__
        got.append(held)
        with open(os.path.join(d, "worker.term"), "a") as f:
            f.write(json.dumps(held) + "\\n")

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(d, "worker.ready"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if mode == "hold" and os.path.exists(os.path.join(d, "release")):
            sys.exit(5)
        if got and mode == "ack":
            ack = {"step": 17, "checkpoint": "/runs/x/checkpoints/step-17", "reason": "stop file: " + got[0].strip(), "time": 1.0}
            with open(stop + ".ack.tmp", "w") as f:
                f.write(json.dumps(ack) + "\\n")
            os.rename(stop + ".ack.tmp", stop + ".ack")
            sys.exit(0)
        if got and mode == "exit":
            sys.exit(3)
        time.sleep(0.05)
    sys.exit(99)
    """
)


def _program(tmp_path: Path) -> Path:
    copy = tmp_path / "copy" / "sbatch-gen-node.py"
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(PROGRAM.read_bytes())
    return copy


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SBATCH_GEN"))}
    env["SLURMD_NODENAME"] = NODE
    return env


def _argv(tmp_path: Path, stop: Path, *command: str, stopped_rc: int = 42) -> list[str]:
    run = [sys.executable, "-I", "-S", str(_program(tmp_path)), "run-trainer"]
    return [*run, "--stop-file", str(stop), "--stopped-rc", str(stopped_rc), "--", *command]


def _start(tmp_path: Path, stop: Path, mode: str) -> subprocess.Popen[str]:
    """run-trainer around torchrun's stand-in, its worker in ``mode``; returns once the worker runs."""
    (tmp_path / "torchrun.py").write_text(TORCHRUN)
    (tmp_path / "worker.py").write_text(WORKER)
    torchrun = [sys.executable, str(tmp_path / "torchrun.py"), str(tmp_path), mode, str(stop)]
    proc = subprocess.Popen(
        _argv(tmp_path, stop, *torchrun),
        env=_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "worker.ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    return proc


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)


def _log_lines(stderr: str) -> list[str]:
    """The program's own lines (``[sbatch-gen TIME] ...``), without the time."""
    return [line.split("] ", 1)[1] for line in stderr.splitlines() if line.startswith("[sbatch-gen ")]


def _terms(tmp_path: Path) -> list[str]:
    f = tmp_path / "worker.term"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def test_sigterm_writes_the_stop_file_then_reaches_the_workers_and_the_ack_gives_the_stopped_rc(tmp_path):
    stop = tmp_path / "stop" / "77.attempt-0"
    stop.parent.mkdir()
    proc = _start(tmp_path, stop, "ack")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 42, err
    # torchrun ran with SIGTERM ignored (inherited SIG_IGN): the SIGTERM reached its worker only, from us
    assert (tmp_path / "torchrun.sigterm").read_text() == "ignored"
    line = f"SIGTERM to the training step on {NODE}\n"
    # the worker's SIGTERM came after the stop file had its line: the trainer's contract
    assert _terms(tmp_path) == [line]
    assert stop.read_text() == line
    assert _log_lines(err) == [
        f"SIGTERM on {NODE}: asking the trainer to checkpoint and stop ({stop})",
        f"node {NODE}: stopped after step 17 (stop file: SIGTERM to the training step on {NODE}): checkpoint"
        " /runs/x/checkpoints/step-17 complete",
    ], err
    assert out == ""


def test_the_workers_sigterm_waits_until_the_stop_file_line_is_written(tmp_path):
    """The order, made visible: the stop file is a FIFO, so writing its line blocks until this test reads
    it. Until then the worker gets no SIGTERM; once the line is read, it does."""
    stop = tmp_path / "stop"
    os.mkfifo(stop)
    proc = _start(tmp_path, stop, "hold")
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert not (tmp_path / "worker.term").exists(), "the worker got SIGTERM before the stop file's line"
    assert proc.poll() is None
    with open(stop) as f:  # unblocks the supervisor's write
        assert f.read() == f"SIGTERM to the training step on {NODE}\n"
    _wait_for(tmp_path / "worker.term")
    assert _terms(tmp_path) == ["a fifo"]
    (tmp_path / "release").touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err  # no ack: the worker's status, through torchrun's
    assert _log_lines(err) == [f"SIGTERM on {NODE}: asking the trainer to checkpoint and stop ({stop})"]


def test_the_wait_survives_repeated_signals_until_torchrun_exits(tmp_path):
    stop = tmp_path / "stop"
    proc = _start(tmp_path, stop, "hold")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
        proc.send_signal(sig)
        time.sleep(0.2)
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    # every SIGTERM: a line in the stop file, then one to the worker (which holds on, as a slow save does)
    assert stop.read_text() == f"SIGTERM to the training step on {NODE}\n" * 3
    assert len(_terms(tmp_path)) == 3
    (tmp_path / "release").touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert "Traceback" not in err and len(_log_lines(err)) == 3, err


def test_a_stop_without_an_ack_gives_the_workers_status(tmp_path):
    stop = tmp_path / "stop"
    proc = _start(tmp_path, stop, "exit")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert _log_lines(err) == [f"SIGTERM on {NODE}: asking the trainer to checkpoint and stop ({stop})"]


def _run(tmp_path: Path, stop: Path, *command: str, stopped_rc: int = 42) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _argv(tmp_path, stop, *command, stopped_rc=stopped_rc),
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("code", "rc"),
    [
        ("import sys; sys.exit(0)", 0),
        ("import sys; sys.exit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9),  # as bash reports it
        # SIGTERM is ignored: a SIGTERM to itself changes nothing
        ("import os, signal, sys; os.kill(os.getpid(), signal.SIGTERM); sys.exit(4)", 4),
    ],
)
def test_the_commands_status_without_a_stop(tmp_path, code, rc):
    r = _run(tmp_path, tmp_path / "stop", sys.executable, "-c", code)
    assert r.returncode == rc, r.stderr
    assert r.stderr == "" and r.stdout == ""


def test_an_ack_gives_the_stopped_rc_whatever_the_commands_status(tmp_path):
    stop = tmp_path / "stop"
    write_ack = (
        "import json, sys; open(sys.argv[1] + '.ack', 'w').write(json.dumps("
        "{'step': 3, 'checkpoint': None, 'reason': 'SIGUSR1'})); sys.exit(1)"
    )
    r = _run(tmp_path, stop, sys.executable, "-c", write_ack, str(stop), stopped_rc=0)
    assert r.returncode == 0, r.stderr
    assert _log_lines(r.stderr) == [f"node {NODE}: stopped after step 3 (SIGUSR1): nothing to checkpoint yet"]


def test_a_stop_checkpoint_that_did_not_complete_is_said_and_the_status_kept(tmp_path):
    stop = tmp_path / "stop"
    (tmp_path / "stop.stopping").write_text("stop checkpoint of step 9 started (SIGTERM); redoes 1-9\nmore\n")
    r = _run(tmp_path, stop, sys.executable, "-c", "import sys; sys.exit(1)")
    assert r.returncode == 1
    assert _log_lines(r.stderr) == [
        f"node {NODE}: WARNING: the stop checkpoint did not complete: stop checkpoint of step 9 started"
        " (SIGTERM); redoes 1-9"
    ]


def test_a_command_that_cannot_start(tmp_path):
    r = _run(tmp_path, tmp_path / "stop", "no-such-torchrun-here", "--nproc-per-node=1")
    assert r.returncode == 127
    assert _log_lines(r.stderr) == ["ERROR: cannot run no-such-torchrun-here: No such file or directory"]


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--stop-file", "s", "--stopped-rc", "0"],  # no command
        ["--stop-file", "s", "--stopped-rc", "0", "torchrun"],  # no --
        ["--stop-file", "s", "--stopped-rc", "x", "--", "torchrun"],
        [
            "--stop-file",
            "s",
            "--stopped-rc",
            "\u00b2",
            "--",
            "torchrun",
        ],  # a digit to str.isdigit, not to int
        ["--stop-file", "s", "--stopped-rc", "256", "--", "torchrun"],  # no exit status
        ["--stopped-rc", "0", "--", "torchrun"],
        ["--stop-file", "s", "--stopped-rc", "0", "--bogus", "1", "--", "torchrun"],
    ],
)
def test_bad_arguments_are_refused(tmp_path, args):
    copy = _program(tmp_path)
    r = subprocess.run(
        [sys.executable, "-I", "-S", str(copy), "run-trainer", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.startswith("usage: sbatch-gen-node.py run-trainer "), r.stderr


@pytest.mark.parametrize("where", ["missing-dir", "under-a-file", "name-too-long"])
def test_a_stop_file_that_cannot_be_written_is_logged_and_the_sigterm_still_goes_on(tmp_path, where):
    if where == "name-too-long":  # fails for root too (a read-only directory would not)
        stop = tmp_path / ("s" * 300)
    elif where == "under-a-file":
        (tmp_path / "a-file").write_text("")
        stop = tmp_path / "a-file" / "stop"
    else:
        stop = tmp_path / "no" / "such" / "dir" / "stop"
    proc = _start(tmp_path, stop, "exit")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err  # the supervisor lived on and waited for torchrun
    lines = _log_lines(err)
    assert len(lines) == 1 and lines[0].startswith(
        f"WARNING: SIGTERM on {NODE}: cannot write the stop file {stop} ("
    ), err
    assert lines[0].endswith("); the trainer hears of the stop from the SIGTERM alone"), err
    terms = _terms(tmp_path)  # the worker got the SIGTERM all the same
    assert len(terms) == 1 and terms[0].startswith("no stop file: "), terms
    assert "Traceback" not in err


# ---- stop_outcome and the rest, in this process -----------------------------------------------------


def test_the_suffixes_are_the_contracts():
    assert np.ACK_SUFFIX == contract.ACK_SUFFIX and np.STOPPING_SUFFIX == contract.STOPPING_SUFFIX
    assert np.FATAL_SUFFIX == contract.FATAL_SUFFIX


@pytest.mark.parametrize(
    ("ack", "said"),
    [
        (
            {"step": 43, "checkpoint": "/r/checkpoints/step-43", "reason": "SIGTERM", "time": 1.5},
            "stopped after step 43 (SIGTERM): checkpoint /r/checkpoints/step-43 complete",
        ),
        (
            {"step": 0, "checkpoint": None, "reason": "x"},
            "stopped after step 0 (x): nothing to checkpoint yet",
        ),
        (
            {"checkpoint": "", "reason": ""},
            "stopped after step ? (stop requested): nothing to checkpoint yet",
        ),
        ({"step": True, "reason": "a\nb"}, "stopped after step ? (a b): nothing to checkpoint yet"),
        (
            {"step": 5, "checkpoint": '/r/é "q"', "reason": "r"},
            'stopped after step 5 (r): checkpoint /r/é "q" complete',
        ),
        ("not json {", "stopped after step ? (stop requested): nothing to checkpoint yet"),
        ([1, 2], "stopped after step ? (stop requested): nothing to checkpoint yet"),
    ],
)
def test_stop_outcome_from_the_ack(tmp_path, ack, said):
    stop = tmp_path / "stop"
    text = ack if isinstance(ack, str) else json.dumps(ack)
    (tmp_path / "stop.ack").write_text(text + "\n")
    (tmp_path / "stop.stopping").write_text("ignored once the ack is there\n")
    assert np.stop_outcome(str(stop)) == said


def test_stop_outcome_from_stopping_or_nothing(tmp_path):
    stop = str(tmp_path / "stop")
    assert np.stop_outcome(stop) is None
    (tmp_path / "stop.stopping").write_text("x" * 600 + "\nsecond line\n")
    assert np.stop_outcome(stop) == "WARNING: the stop checkpoint did not complete: " + "x" * 500
    (tmp_path / "stop.stopping").write_text("")
    assert np.stop_outcome(stop) == "WARNING: the stop checkpoint did not complete: "


def test_child_pids_from_proc(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"],
    )
    try:
        deadline = time.monotonic() + 30
        while not np.child_pids(parent.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (kid,) = np.child_pids(parent.pid)
        # the child is listed once forked, before it has exec'd sleep (until then its cmdline is python's)
        while Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert np.child_pids(kid) == []
        os.kill(kid, signal.SIGKILL)
    finally:
        parent.kill()
        parent.wait()
    assert np.child_pids(parent.pid) == []


def test_log_is_the_launchers_format(capsys):
    np.log("hello")
    err = capsys.readouterr().err
    assert err.startswith("[sbatch-gen 20") and err.endswith("Z] hello\n") and len(err) == len(LOG_LINE) + 6


# An older torch (2.4-like): its torchrun refuses --signals-to-handle and --shutdown-timeout, and its agent
# installs a SIGTERM handler of its own (which would stop the workers), then runs the worker as torchrun's
# stand-in does. It notes whether SIGTERM is still ignored after it tried.
OLD_RUN_PY = textwrap.dedent(
    """\
    import os, signal, subprocess, sys

    def main(args=None):
        args = sys.argv[1:] if args is None else args
        for a in args:
            if a.startswith("--"):  # this one knows none of the flags the test gives
                print("torchrun: error: unrecognized arguments: " + a, file=sys.stderr)
                sys.exit(2)
        d = args[1]

        def agent_dies(signum, frame):
            open(os.path.join(d, "agent.died"), "w").close()
            sys.exit(143)

        signal.signal(signal.SIGTERM, agent_dies)
        ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        open(os.path.join(d, "torchrun.sigterm"), "w").write("ignored" if ignored else "not ignored")
        worker = subprocess.Popen(
            [sys.executable, *args], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)
        )
        sys.exit(worker.wait())
    """
)


def _old_torch_venv(root: Path) -> Path:
    """A venv whose torch is an older one (its version.py and distributed/run.py only): its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    site = next(root.glob("lib/python*/site-packages"))
    (site / "torch" / "distributed").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_text("__version__ = '2.4.1'\n")
    (site / "torch" / "distributed" / "__init__.py").write_text("")
    (site / "torch" / "distributed" / "run.py").write_text(OLD_RUN_PY)
    return root / "bin" / "python"


def test_an_older_torchrun_runs_through_the_compat_shim_and_the_stop_still_checkpoints(tmp_path):
    """torch without --signals-to-handle: run-trainer drops the two flags and starts torchrun through the
    node program's torchrun-compat, whose agent never takes SIGTERM (it stays ignored); the stop goes to the
    worker through the stop file as on a newer torch, and the ack gives the stopped status."""
    python = _old_torch_venv(tmp_path / "venv")
    stop = tmp_path / "stop" / "77.attempt-0"
    stop.parent.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    flags = ["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout=300"]
    argv = [str(python), "-I", str(_program(tmp_path)), "run-trainer", "--stop-file", str(stop)]
    argv += ["--stopped-rc", "0", "--", "torchrun", *flags, str(tmp_path / "worker.py"), str(tmp_path)]
    argv += ["ack", str(stop)]
    proc = subprocess.Popen(argv, env=_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "worker.ready")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (tmp_path / "torchrun.sigterm").read_text() == "ignored"  # the shim kept the agent from it
    assert not (tmp_path / "agent.died").exists()
    assert _terms(tmp_path) == [f"SIGTERM to the training step on {NODE}\n"]
    assert _log_lines(err) == [
        "this torch's torchrun has no --signals-to-handle, --shutdown-timeout: it runs through the node "
        "program's compat shim, which keeps SIGTERM from its agent (the stop goes through the stop file); "
        "--signals-to-handle, --shutdown-timeout dropped",
        f"SIGTERM on {NODE}: asking the trainer to checkpoint and stop ({stop})",
        f"node {NODE}: stopped after step 17 (stop file: SIGTERM to the training step on {NODE}): checkpoint"
        " /runs/x/checkpoints/step-17 complete",
    ], err


def test_torchs_torchrun_runs_through_the_node_programs_wrapper_and_nothing_else_does(tmp_path, monkeypatch):
    """torch's own torchrun (its console script on PATH; this torch has both flags) runs through the node
    program's `torchrun`, its arguments as given but for what a Slurm step adds; a site's torchrun wrapper
    and any other program run as given."""
    venv_bin = Path(sys.executable).parent
    assert b"torch.distributed.run" in (venv_bin / "torchrun").read_bytes()
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.setenv("PATH", f"{venv_bin}:/usr/bin:/bin")
    wrapped = [sys.executable, str(PROGRAM), "torchrun"]
    assert np.torchrun_command(["torchrun", "--shutdown-timeout=300", "x.py"]) == [
        *wrapped,
        "--",
        "--shutdown-timeout=300",
        "x.py",
    ]
    assert np.torchrun_command(["torchrun", "x.py"], exit_barrier_s=60) == [
        *wrapped,
        "--exit-barrier-s",
        "60",
        "--",
        "x.py",
    ]
    tagged = ["env", "SBATCH_GEN_TAG=t1", "torchrun", "x.py"]  # the SSH launcher's
    assert np.torchrun_command(tagged) == ["env", "SBATCH_GEN_TAG=t1", *wrapped, "--", "x.py"]
    assert np.torchrun_command(["python", "--shutdown-timeout=300"]) == ["python", "--shutdown-timeout=300"]
    assert np.torchrun_command(["torchrun", "x.py"], 60, "ib0") == [
        *wrapped,
        *("--exit-barrier-s", "60", "--local-ifname", "ib0", "--", "x.py"),
    ]
    # a site's own torchrun (a wrapper script) is not torch's entry point
    site = tmp_path / "bin"
    site.mkdir()
    (site / "torchrun").write_text('#!/bin/sh\nexec python -m torch.distributed.run "$@"\n')
    (site / "torchrun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{site}:{venv_bin}:/usr/bin:/bin")
    assert np.torchrun_command(["torchrun", "x.py"], 60) == ["torchrun", "x.py"]


def test_in_a_slurm_step_the_wrapper_names_the_rendezvous(monkeypatch):
    """Node 0 of the allocation hosts the c10d store (is_host added to --rdzv-conf, either spelling), the
    interface's address is --local-addr; what the launch gives stays; outside a Slurm step nothing changes."""
    conf = "--rdzv-conf=join_timeout=900"
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    assert np.slurm_rendezvous([conf, "x.py"], "lo") == [conf, "x.py"]
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert np.slurm_rendezvous([conf, "x.py"], "lo") == [
        "--local-addr=127.0.0.1",
        "--rdzv-conf=join_timeout=900,is_host=1",
        "x.py",
    ]
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert np.slurm_rendezvous(["--rdzv-conf", "join_timeout=900", "x.py"]) == [
        "--rdzv-conf=join_timeout=900,is_host=0",
        "x.py",
    ]
    assert np.slurm_rendezvous(["x.py"], "no-such-if0") == ["--rdzv-conf=is_host=0", "x.py"]
    given = ["--rdzv-conf=join_timeout=9,is_host=1", "--local-addr=10.0.0.1", "x.py"]
    assert np.slurm_rendezvous(given, "lo") == given


def test_the_ssh_launchers_tagged_torchrun_goes_through_the_shim_too(tmp_path):
    python = _old_torch_venv(tmp_path / "venv")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import sbatch_gen.node_program as n; "
        "print(n.torchrun_command(['env', 'SBATCH_GEN_TAG=t1', 'torchrun', '--shutdown-timeout=300', 'x.py']))"
    )
    out = subprocess.run([str(python), "-c", code, str(REPO)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(
        ["env", "SBATCH_GEN_TAG=t1", str(python), str(PROGRAM), "torchrun", "--keep-sigterm", "--", "x.py"]
    ), out.stdout


# ---- a crash: node 0 announces the region's leave ------------------------------------------------------

# torchrun's stand-in for a crash: exits with $FAKE_TORCHRUN_RC (1), after writing the ack of a completed stop
# when $FAKE_TORCHRUN_ACK names the stop file.
CRASHING_TORCHRUN = textwrap.dedent(
    """\
    import json, os, sys
    ack = os.environ.get("FAKE_TORCHRUN_ACK")
    if ack:
        with open(ack + ".ack", "w") as f:
            f.write(json.dumps({"step": 8, "checkpoint": None, "reason": "SIGTERM"}))
    sys.exit(int(os.environ.get("FAKE_TORCHRUN_RC", "1")))
    """
)

# The leave announcer's stand-in, found first as `python -m sbatch_gen.train.xr.leave` in run-trainer's working
# directory (a package of that name there): notes its arguments in announced.jsonl, then by $FAKE_LEAVE:
# "ok" says its line, "hang" never ends, "traceback" dies of an exception.
FAKE_LEAVE = textwrap.dedent(
    """\
    import json, os, sys, time
    with open("announced.jsonl", "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}) + "\\n")
    mode = os.environ.get("FAKE_LEAVE", "ok")
    if mode == "hang":
        time.sleep(300)
    if mode == "traceback":
        raise RuntimeError("the store is down")
    print("announced the leave of region b in the mailbox fs:/mb/run after torchrun exited with status " + sys.argv[2])
    """
)

XR_ARGS = [
    "--config",
    "c.yaml",
    "--run-dir",
    "runs/b",
    "--xr-enabled",
    "--xr-region",
    "b",
    "--xr-regions",
    "a,b",
]


def _fake_leave(tmp_path: Path) -> None:
    pkg = tmp_path / "sbatch_gen" / "train" / "xr"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "leave.py").write_text(FAKE_LEAVE)


def _fake_torchrun(tmp_path: Path) -> str:
    torchrun = tmp_path / "bin" / "torchrun"
    torchrun.parent.mkdir()
    torchrun.write_text(f"#!{sys.executable}\n" + CRASHING_TORCHRUN)
    torchrun.chmod(0o755)
    return str(torchrun)


def _announced(tmp_path: Path) -> list[list[str]]:
    f = tmp_path / "announced.jsonl"
    return [json.loads(x)["argv"] for x in f.read_text().splitlines()] if f.exists() else []


def _crash(tmp_path: Path, command: list[str], env: dict[str, str], stopped_rc: int = 42):
    """run-trainer around the crashing torchrun (``command`` after its path), with the fake announcer."""
    _fake_leave(tmp_path)
    stop = tmp_path / "stop"
    argv = _argv(tmp_path, stop, _fake_torchrun(tmp_path), *command, stopped_rc=stopped_rc)
    t0 = time.monotonic()
    r = subprocess.run(argv, env={**_env(), **env}, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    return r, time.monotonic() - t0


TORCHRUN_ARGS = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0"]


@pytest.mark.parametrize(
    ("where", "env", "module"),
    [
        ("one node, no launcher", {}, "sbatch_gen.train"),
        ("a Slurm job step", {"SLURM_NODEID": "0"}, "sbatch_gen.train"),
        ("the SSH launcher", {"SBATCH_GEN_NODE_RANK": "0", "SLURM_NODEID": "3"}, "sbatch_gen.train"),
        ("the test faults", {"SLURM_NODEID": "0"}, "sbatch_gen.testing.faults"),
    ],
)
def test_a_crash_of_a_cross_region_trainer_announces_its_leave_once_on_node_0(tmp_path, where, env, module):
    r, _ = _crash(tmp_path, [*TORCHRUN_ARGS, "-m", module, *XR_ARGS], {**env, "FAKE_TORCHRUN_RC": "3"})
    assert r.returncode == 3, r.stderr  # torchrun's status, announced or not
    assert _announced(tmp_path) == [["--torchrun-status", "3", "--", *XR_ARGS]], where
    assert _log_lines(r.stderr) == [
        "announced the leave of region b in the mailbox fs:/mb/run after torchrun exited with status 3"
    ], r.stderr
    assert r.stdout == ""


def test_the_ssh_launchers_tagged_torchrun_announces_too(tmp_path):
    _fake_leave(tmp_path)
    stop = tmp_path / "stop"
    command = ["env", "SBATCH_GEN_TAG=t1", _fake_torchrun(tmp_path), *TORCHRUN_ARGS, "-m", "sbatch_gen.train"]
    r = subprocess.run(
        _argv(tmp_path, stop, *command, *XR_ARGS),
        env={**_env(), "SBATCH_GEN_NODE_RANK": "0"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert _announced(tmp_path) == [["--torchrun-status", "1", "--", *XR_ARGS]]


def test_a_stop_that_did_not_complete_announces_too(tmp_path):
    """A stop file but no ack: the stop did not complete (or a SIGTERM reached run-trainer while torchrun
    failed: Slurm's --kill-on-bad-exit). The region is gone all the same; the announcer keeps a leave record
    the trainer wrote itself."""
    (tmp_path / "stop").write_text("SIGTERM to the training step on n7\n")
    (tmp_path / "stop.stopping").write_text("stop checkpoint of step 9 started\n")
    r, _ = _crash(tmp_path, [*TORCHRUN_ARGS, "-m", "sbatch_gen.train", *XR_ARGS], {})
    assert r.returncode == 1, r.stderr
    assert _announced(tmp_path) == [["--torchrun-status", "1", "--", *XR_ARGS]]


@pytest.mark.parametrize(
    ("why", "command", "env"),
    [
        ("node 1 of a Slurm job", ["-m", "sbatch_gen.train", *XR_ARGS], {"SLURM_NODEID": "1"}),
        ("node 1 of the SSH launcher", ["-m", "sbatch_gen.train", *XR_ARGS], {"SBATCH_GEN_NODE_RANK": "1"}),
        ("a planned stop: its ack", ["-m", "sbatch_gen.train", *XR_ARGS], {"FAKE_TORCHRUN_ACK": "stop"}),
        ("status 0", ["-m", "sbatch_gen.train", *XR_ARGS], {"FAKE_TORCHRUN_RC": "0"}),
        ("a trainer script of one's own", ["train.py", *XR_ARGS], {}),
        ("a trainer module of one's own", ["-m", "mytrainer", *XR_ARGS], {}),
        ("no cross-region sync", ["-m", "sbatch_gen.train", "--config", "c.yaml"], {}),
    ],
)
def test_no_leave_is_announced(tmp_path, why, command, env):
    r, _ = _crash(tmp_path, [*TORCHRUN_ARGS, *command], env, stopped_rc=0)
    rc = 0 if why.startswith(("a planned stop", "status 0")) else 1
    assert r.returncode == rc, r.stderr
    assert _announced(tmp_path) == [], why
    said = [f"node {NODE}: stopped after step 8 (SIGTERM): nothing to checkpoint yet"] if "ack" in why else []
    assert _log_lines(r.stderr) == said, r.stderr


def test_a_fatal_stop_announces_no_leave(tmp_path):
    """.fatal: the trainer stopped on an error no requeue fixes, e.g. the run dir leased by another live job
    (whose region is not gone)."""
    (tmp_path / "stop.fatal").write_text("run dir runs/b is leased by job 12 on host x\n")
    r, _ = _crash(tmp_path, [*TORCHRUN_ARGS, "-m", "sbatch_gen.train", *XR_ARGS], {})
    assert r.returncode == 1, r.stderr
    assert _announced(tmp_path) == []


def test_an_announcer_that_fails_is_one_warning_and_the_status_stays(tmp_path):
    r, _ = _crash(tmp_path, [*TORCHRUN_ARGS, "-m", "sbatch_gen.train", *XR_ARGS], {"FAKE_LEAVE": "traceback"})
    assert r.returncode == 1, r.stderr
    assert len(_announced(tmp_path)) == 1
    assert _log_lines(r.stderr) == [
        "WARNING: the leave announcer exited with status 1: RuntimeError: the store is down"
    ], r.stderr
    assert "Traceback" not in r.stderr


def test_an_announcer_that_hangs_is_cut_at_the_bound(tmp_path, monkeypatch):
    _fake_leave(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAKE_LEAVE", "hang")
    t0 = time.monotonic()
    said = np.announce_leave(XR_ARGS, 1, timeout_s=1.0)
    took = time.monotonic() - t0
    assert 1.0 <= took < 10, took
    assert said == (
        "WARNING: the leave announcer did not finish in 1 s (the mailbox did not answer?): the other regions "
        "find this region gone by its heartbeat or grace_s"
    )
    (ran,) = [json.loads(x) for x in (tmp_path / "announced.jsonl").read_text().splitlines()]
    deadline = time.monotonic() + 10
    while Path(f"/proc/{ran['pid']}").exists():  # killed (and reaped): nothing of it outlives the bound
        assert time.monotonic() < deadline, "the announcer still runs"
        time.sleep(0.05)


def test_the_bound_is_a_few_seconds():
    assert 2 <= np.LEAVE_TIMEOUT_S <= 15


@pytest.mark.parametrize(
    ("command", "got"),
    [
        (
            ["torchrun", "--nnodes", "2", "-m", "sbatch_gen.train", "--a", "1"],
            ("sbatch_gen.train", ["--a", "1"]),
        ),
        (["/v/bin/torchrun", "--module", "m.n"], ("m.n", [])),
        (["env", "A=1", "B=2", "torchrun", "-m", "x", "-m", "y"], ("x", ["-m", "y"])),
        (["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=1", "-m", "x", "--b"], ("x", ["--b"])),
        (["torchrun", "--standalone", "--tee=3", "-r", "0:3", "-m", "x"], ("x", [])),
        (["torchrun", "--nnodes", "1", "train.py", "-m", "x"], None),  # the script's own -m
        (["torchrun", "--nnodes", "1", "train.py"], None),
        (["torchrun", "-m"], None),
        (["python", "-m", "sbatch_gen.train"], None),
        (["env", "A=1"], None),
        ([], None),
    ],
)
def test_trainer_of(command, got):
    assert np.trainer_of(command) == got
