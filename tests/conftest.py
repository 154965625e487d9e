"""Shared test helpers. Each area keeps its own fixtures in tests/<area>/conftest.py."""

import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background (`make test &`, nohup, a CI runner without job control) inherits SIGINT
# and SIGQUIT ignored, and every launcher and torchrun the tests start would inherit that too (bash cannot
# trap a signal that was ignored when it started): Ctrl-C on a launcher would do nothing. The tests press
# Ctrl-C the way a terminal delivers it, so give their children the dispositions a terminal gives.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def venv_bin() -> Path:
    """bin/ of the interpreter running the tests (the project's .venv under make test)."""
    return Path(sys.executable).parent


@pytest.fixture
def clean_env(monkeypatch):
    """An environment without the caller's SLURM_*/torchrun variables leaking into subprocesses."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "TORCHELASTIC_", "SBATCH_GEN_")) or k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "LOCAL_WORLD_SIZE",
        ):
            monkeypatch.delenv(k, raising=False)
    return os.environ


# `make test` runs the suite in TEST_WORKERS pytest-xdist processes with `--dist loadgroup`. Each test
# joins one group, and a group runs in one process, in order:
# - "slurm": tests/e2e. There is one local Slurm cluster and its tests assume they own it (its
#   partitions, its nodes' processes, preemption between jobs); they run one after another, first, since
#   they are the longest chain and mostly wait on Slurm.
# - "netns": tests/bench. The WAN emulations create network namespaces with fixed names.
# - every other test file is its own group, so its module fixtures (a reference run, a clone) are built once.
_SERIAL_GROUPS = {"e2e": "slurm", "bench": "netns"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config, items):
    if config.getoption("dist", default="no") != "loadgroup":
        return
    tests_dir = Path(__file__).resolve().parent

    def group(item) -> str:
        rel = Path(str(item.path)).resolve().relative_to(tests_dir)
        return _SERIAL_GROUPS.get(rel.parts[0], rel.as_posix())

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    # the groups go out in collection order (make test passes --no-loadscope-reorder): Slurm's first
    items.sort(key=lambda item: group(item) != "slurm")
