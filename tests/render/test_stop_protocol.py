"""trainer.stop_protocol and trainer.stop_grace_s: what they render and what they refuse.

- sbatch-gen (the default): torchrun handles every default signal but SIGTERM (run-trainer runs it with
  SIGTERM ignored: a SIGTERM is the workers' stop request), and gives its workers the stop budget before
  SIGKILL when it does stop them: preemption.checkpoint_s + margin_s (Slurm), launch.kill_grace_s (SSH);
- signal: torchrun is told to handle the stop signal (Slurm: preemption.signal; SSH: SIGTERM, which is
  what the launcher sends) and to give its workers the grace before SIGKILL; the grace is
  trainer.stop_grace_s, else preemption.checkpoint_s + margin_s (Slurm) or launch.kill_grace_s (SSH);
- the grace must leave time to requeue before the time limit (Slurm), and a grace without the signal
  protocol is refused, each as one `file:line: field: message` line.

What the scripts do with it runs under bash in test_signals.py and test_requeue.py (Slurm) and for real
in tests/ssh/test_ssh_stop_protocols.py and tests/e2e/test_stop_protocols.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from sbatch_gen.launch import SLURM, SSH, TORCHRUN_DEFAULT_SIGNALS, torchrun_argv
from sbatch_gen.loader import load_site
from sbatch_gen.render import SSH_LIBRARY_FILE, render_site

from .conftest import REPO, sg


def _flags(site: str, *sets: str) -> dict[str, str | None]:
    """torchrun's stop flags for a site with overrides: {flag: the Option's key}."""
    p = load_site(REPO / "sites", site, list(sets)).profile
    launcher = SLURM if site != "ssh-local" else SSH
    out: dict[str, str | None] = {}
    for o in torchrun_argv(p, launcher):
        word = o.words[0]
        if isinstance(word, str) and word.startswith(("--signals-to-handle", "--shutdown-timeout")):
            out[word] = o.key
    return out


@pytest.mark.parametrize("site", ["local", "eu", "ssh-local"])
def test_no_stop_flags_with_the_none_protocol(site):
    assert _flags(site, "trainer.stop_protocol=none") == {}


NOT_TERM = "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"


def test_default_protocol_keeps_sigterm_from_torchrun_and_gives_it_the_stop_budget():
    """Whatever stops torchrun's workers (a signal it handles, a failed worker) waits the stop budget before
    SIGKILL, not torchrun's own 30 s; SIGTERM is no signal of torchrun's (the workers' stop request)."""
    assert _flags("local") == {
        NOT_TERM: "trainer.stop_protocol: sbatch-gen",
        "--shutdown-timeout=30": "preemption.checkpoint_s + preemption.margin_s",  # local: 10 + 20
    }
    assert (
        _flags("eu")["--shutdown-timeout=300"] == "preemption.checkpoint_s + preemption.margin_s"
    )  # 180 + 120
    assert _flags("ssh-local", "launch.kill_grace_s=95") == {
        NOT_TERM: "trainer.stop_protocol: sbatch-gen",
        "--shutdown-timeout=95": "launch.kill_grace_s",
    }


def test_slurm_signal_protocol_makes_torchrun_forward_the_preemption_signal():
    assert _flags("local", "trainer.stop_protocol=signal") == {
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1": "trainer.stop_protocol: signal",
        # local: checkpoint_s 10 + margin_s 20
        "--shutdown-timeout=30": "preemption.checkpoint_s + preemption.margin_s (trainer.stop_grace_s unset)",
    }
    assert _flags(
        "local", "trainer.stop_protocol=signal", "preemption.signal=USR2", "trainer.stop_grace_s=45"
    ) == {
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2": "trainer.stop_protocol: signal",
        "--shutdown-timeout=45": "trainer.stop_grace_s",
    }


def test_ssh_signal_protocol_gives_torchrun_the_grace_for_the_sigterm_of_the_launcher():
    assert _flags("ssh-local", "trainer.stop_protocol=signal") == {
        "--signals-to-handle=" + ",".join(TORCHRUN_DEFAULT_SIGNALS): "trainer.stop_protocol: signal",
        "--shutdown-timeout=10": "launch.kill_grace_s (trainer.stop_grace_s unset)",  # ssh-local: 10
    }
    assert "--shutdown-timeout=90" in _flags(
        "ssh-local", "trainer.stop_protocol=signal", "trainer.stop_grace_s=90"
    )


@pytest.mark.parametrize(
    "sets, grace_line",
    [
        ([], "KILL_GRACE_S=10  # launch.kill_grace_s (trainer.stop_grace_s unset)"),
        (["trainer.stop_grace_s=75"], "KILL_GRACE_S=75  # trainer.stop_grace_s"),
    ],
)
def test_ssh_launcher_waits_the_same_grace_before_sigkill(sets, grace_line):
    text = render_site(load_site(REPO / "sites", "ssh-local", ["trainer.stop_protocol=signal", *sets]))[
        0
    ].text
    assert f"\n{grace_line}\n" in text
    grace = grace_line.split("=")[1].split()[0]
    assert f"    --shutdown-timeout={grace}  #" in text  # torchrun's own grace is the launcher's


@pytest.mark.slow  # real processes and signals, a second's wait
@pytest.mark.parametrize("protocol", ["none", "sbatch-gen"])
def test_ssh_none_protocol_sigkills_at_once(tmp_path, protocol):
    """The launcher says none (no grace); the SSH library's cleanup_main, run as a node runs it, sends a
    tagged process that would save on SIGTERM a SIGKILL at once with none, a SIGTERM first with sbatch-gen."""
    text = render_site(load_site(REPO / "sites", "ssh-local", [f"trainer.stop_protocol={protocol}"]))[0].text
    assert f"\nSTOP_PROTOCOL={protocol}  # trainer.stop_protocol" in text
    assert ("\nKILL_GRACE_S=0\n" in text) == (protocol == "none")
    tag, saved, ready = f"sbg-test-{os.getpid()}", tmp_path / "saved", tmp_path / "ready"
    victim = subprocess.Popen(
        ["bash", "-c", f"trap 'touch {saved}; exit 0' TERM; touch {ready}; while :; do sleep 0.1; done"],
        env={**os.environ, "SBATCH_GEN_TAG": tag},
    )
    deadline = time.monotonic() + 30
    while not ready.exists():  # its trap is set
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.02)
    grace = "0" if protocol == "none" else "30"  # as the launcher's KILL_GRACE_S: none has no grace
    try:
        r = subprocess.run(
            ["bash", "-c", f'source {REPO / "out" / SSH_LIBRARY_FILE}\nSTOP_PROTOCOL={protocol}\ncleanup_main "$@"',
             "node", tag, grace, "0"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert victim.wait(10) == (-signal.SIGKILL if protocol == "none" else 0), r.stdout
        assert saved.exists() == (protocol == "sbatch-gen"), r.stdout
        assert ("SIGTERM to" in r.stdout) == (protocol == "sbatch-gen"), r.stdout
    finally:
        victim.kill()


def test_slurm_signal_render_names_the_grace_and_drops_the_ack_timeout():
    text = render_site(load_site(REPO / "sites", "local", ["trainer.stop_protocol=signal"]))[0].text
    assert (
        "\nSTOP_GRACE_S=30  # preemption.checkpoint_s + preemption.margin_s (trainer.stop_grace_s unset)\n"
        in text
    )
    assert "ACK_TIMEOUT_S" not in text  # only the sbatch-gen protocol waits for an .ack
    assert ': >"$STOP_FILE"' not in text  # nor creates the stop file


def _line_of(path, needle):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


def test_a_grace_without_the_signal_protocol_is_refused(work):
    local = work / "sites" / "local.yaml"
    local.write_text(local.read_text().replace("  resume: auto\n", "  resume: auto\n  stop_grace_s: 20\n", 1))
    r = sg("validate")
    assert r.code == 2 and "Traceback" not in r.err
    line = _line_of(local, "stop_grace_s: 20")
    assert (
        f"sites/local.yaml:{line}: trainer.stop_grace_s: only stop_protocol: signal uses stop_grace_s "
        "(stop_protocol is sbatch-gen): remove it"
    ) in r.err, r.err


@pytest.mark.parametrize(
    "sets, where, source",
    [
        (
            ["trainer.stop_grace_s=60"],
            re.escape("--set trainer.stop_grace_s=60"),
            "trainer.stop_grace_s = 60 s",
        ),
        (
            ["preemption.checkpoint_s=30", "preemption.margin_s=30"],
            r"sites/local\.yaml:\d+",  # the trainer section: the grace is not written anywhere
            "preemption.checkpoint_s + preemption.margin_s (trainer.stop_grace_s unset) = 60 s",
        ),
    ],
)
def test_a_grace_that_leaves_no_time_to_requeue_is_refused(work, sets, where, source):
    r = sg("render", "--site", "local", "--out", "o", "--set", "trainer.stop_protocol=signal", *_sets(sets))
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert re.search(
        rf"^(sbatch-gen: )?{where}: trainer\.stop_grace_s: the grace of stop_protocol signal, "
        + re.escape(source)
        + r", is not shorter than preemption\.lead_time_s \(60 s\)",
        r.err,
        re.M,
    ), r.err
    assert len(r.err.strip().splitlines()) == 1, r.err


def test_unknown_protocol_lists_the_choices(work):
    r = sg("render", "--site", "local", "--out", "o", "--set", "trainer.stop_protocol=sigterm")
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert "trainer.stop_protocol" in r.err and "'sbatch-gen', 'signal' or 'none'" in r.err, r.err


def _sets(sets: list[str]) -> list[str]:
    return [w for s in sets for w in ("--set", s)]
