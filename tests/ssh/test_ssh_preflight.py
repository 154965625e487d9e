"""Preflight: a host that lacks the trainer, the pinned interface or ssh aborts the whole launch before
anything starts, and the message names that host.

The broken "remote host" is this machine seen through a namespace: an sshd in a private mount
namespace where the checkout's package directory is hidden (the trainer is missing there), or an sshd
in its own network namespace (it has only lo, not the launcher's interface).
"""

from __future__ import annotations

import pytest
from sshkit import free_port, start_sshd, stop_sshd, tagged_pids

pytestmark = pytest.mark.slow  # a real sshd

# A network namespace for the launcher with an interface only it has (a veth pair inside it).
LAUNCHER_NETNS = (
    "unshare",
    "--net",
    "bash",
    "-c",
    "set -e; ip link set lo up; ip link add sbgt0 type veth peer name sbgt1; "
    'ip addr add 10.254.0.1/24 dev sbgt0; ip link set sbgt0 up; ip link set sbgt1 up; exec "$@"',
    "launcher-netns",
)


def _assert_nothing_started(launch) -> None:
    assert not list(launch.logs.glob("attempt-*.node-*.log")), "preflight failed but nodes were started"
    assert not tagged_pids(launch.tag)
    assert not (launch.run_dir / "metrics.jsonl").exists()


def test_missing_trainer_on_a_remote_host_aborts_and_names_it(ssh_launch, repo, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    server = start_sshd(
        tmp_path / "sshd-mntns",
        wrap=("unshare", "--mount", "--propagation", "private"),
        setup=f"mount --bind {empty} {repo / 'sbatch_gen'}",
    )
    try:
        launch = ssh_launch(server=server)
        assert launch.wait(timeout=120) == 3, launch.output()
    finally:
        stop_sshd(server)
    out = launch.output()
    assert "preflight FAILED on node 1 (localhost): trainer module sbatch_gen.train not importable" in out, (
        out
    )
    assert "FAILED on node 0" not in out
    assert "nothing was started" in out
    _assert_nothing_started(launch)


def test_missing_interface_on_a_remote_host_aborts_and_names_it(ssh_launch, tmp_path):
    server = start_sshd(
        tmp_path / "sshd-netns",
        names=("nsbox",),
        wrap=("unshare", "--net"),
        setup="ip link set lo up",
        netns=True,
    )
    try:
        launch = ssh_launch(
            "network.socket_ifname=sbgt0", "hosts=[127.0.0.1, nsbox]", server=server, wrap=LAUNCHER_NETNS
        )
        assert launch.wait(timeout=120) == 3, launch.output()
    finally:
        stop_sshd(server)
    out = launch.output()
    assert "rendezvous 10.254.0.1:" in out  # MASTER_ADDR: the pinned interface's address on node 0
    assert (
        "preflight FAILED on node 1 (nsbox): network interface sbgt0 does not exist (network.socket_ifname); "
        "have: lo\n"
    ) in out, out
    assert "FAILED on node 0" not in out
    _assert_nothing_started(launch)


def test_unreachable_host_aborts_and_names_it(ssh_launch):
    launch = ssh_launch(f"ssh.port={free_port()}")  # nothing listens there
    assert launch.wait(timeout=120) == 3, launch.output()
    out = launch.output()
    assert "preflight FAILED on node 1 (localhost): ssh cannot reach it" in out, out
    _assert_nothing_started(launch)


def test_missing_train_config_is_reported_for_every_host(ssh_launch, tmp_path):
    launch = ssh_launch(f"trainer.config={tmp_path / 'no-such.yaml'}")
    assert launch.wait(timeout=120) == 3, launch.output()
    out = launch.output()
    for label in ("node 0 (127.0.0.1)", "node 1 (localhost)"):
        assert f"preflight FAILED on {label}: train config {tmp_path / 'no-such.yaml'} not readable" in out, (
            out
        )
    _assert_nothing_started(launch)
