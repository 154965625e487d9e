"""The SSH launcher's preflight checks, run locally under bash: no sshd, no launch (fast).

The launcher is rendered for this test, sourced without its last line (`main "$@"`), and a node's
preflight runs exactly as a remote host runs it: `bash -c "$NODE_PROGRAM" sbatch-gen-node preflight_main
RANK`. Covered here: node 0's rendezvous port already taken, and the run dir that must be the one node 0
sees (launch.shared_run_dir); preflight_all's launcher line naming the node."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from sshkit import free_port, launcher_lib, run_lib

pytestmark = pytest.mark.slow  # runs the launcher's preflight on a fake node (iproute2's ip: make install)


def _preflight_node(lib: Path, rank: int, before: str = "") -> subprocess.CompletedProcess:
    return run_lib(lib, f'{before}\nbash -c "$NODE_PROGRAM" sbatch-gen-node preflight_main {rank}')


def test_preflight_passes_on_both_nodes_when_all_is_well(tmp_path):
    port = free_port()
    lib = launcher_lib(tmp_path, port)
    r0 = _preflight_node(lib, 0)
    assert r0.returncode == 0, r0.stdout + r0.stderr
    assert "FAILED" not in r0.stderr, r0.stderr
    assert f", rendezvous port {port} free" in r0.stdout, r0.stdout
    r1 = _preflight_node(lib, 1, before='mkdir -p -- "$RUN_DIR" && : >"$RUN_DIR/.sbatch-gen-shared.$TAG"')
    assert r1.returncode == 0, r1.stdout + r1.stderr
    assert ", run dir shared with node 0" in r1.stdout, r1.stdout
    # one line per node, and it names everything it checked
    (ok,) = [x for x in r1.stdout.splitlines() if x.startswith("preflight ok on ")]
    for found in (
        " python ",
        ", torchrun ",
        ", sbatch_gen.train and torch importable, ",
        ", train config ",
        ", interface lo 127.0.0.1, ",
        f", run dir {tmp_path / 'run'} writable, ",
    ):
        assert found in ok, ok


def test_busy_rendezvous_port_fails_on_node0_only(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        lib = launcher_lib(tmp_path, port)
        r0 = _preflight_node(lib, 0)
        r1 = _preflight_node(lib, 1, before='mkdir -p -- "$RUN_DIR" && : >"$RUN_DIR/.sbatch-gen-shared.$TAG"')
    assert r0.returncode != 0
    assert (
        f": cannot listen on rendezvous port {port}: Address already in use (torchrun.rdzv_port; another "
        "launch?)\n"
    ) in r0.stderr, r0.stderr
    assert r1.returncode == 0, r1.stdout  # only node 0 hosts the rendezvous


def test_busy_rendezvous_port_is_named_in_the_launcher_log(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        lib = launcher_lib(tmp_path, port, "hosts=[127.0.0.1]")
        r = run_lib(lib, 'mkdir -p -- "$LOGS"; ATTEMPT=1; preflight_all')
    assert r.returncode != 0
    assert (
        f"preflight FAILED on node 0 (127.0.0.1): cannot listen on rendezvous port {port}: Address already in "
        "use (torchrun.rdzv_port; another launch?)\n"
    ) in r.stderr, r.stderr


def test_run_dir_node0_does_not_see_fails_on_the_other_node(tmp_path):
    lib = launcher_lib(tmp_path, free_port())
    # No marker: node 0 (preflight_all) writes .sbatch-gen-shared.<tag> in its run dir before the
    # preflights; a node that does not see it has another filesystem at that path.
    r1 = _preflight_node(lib, 1)
    assert r1.returncode != 0
    run_dir = tmp_path / "run"
    assert (
        f": run dir {run_dir} is not the one node 0 sees (checkpoints need a filesystem all nodes share)\n"
    ) in r1.stderr, r1.stderr
    # A marker of another launch (another tag) does not count.
    r1 = _preflight_node(lib, 1, before=': >"$RUN_DIR/.sbatch-gen-shared.sbg-x-1-1"')
    assert r1.returncode != 0 and "is not the one node 0 sees" in r1.stderr, r1.stderr


def test_run_dir_check_is_off_with_shared_run_dir_false(tmp_path):
    lib = launcher_lib(tmp_path, free_port(), "launch.shared_run_dir=false")
    r1 = _preflight_node(lib, 1)
    assert r1.returncode == 0, r1.stdout + r1.stderr
    assert (
        "run dir shared" not in r1.stdout + r1.stderr
        and "not the one node 0 sees" not in r1.stdout + r1.stderr
    )
