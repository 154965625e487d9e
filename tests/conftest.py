"""Shared test helpers. Each area keeps its own fixtures in tests/<area>/conftest.py."""

import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# pytest caches each test module it rewrote (its asserts) in __pycache__, unless Python may not write
# bytecode: with PYTHONDONTWRITEBYTECODE set (as in some containers) every pytest process rewrites every
# test module again, about 7 s of each xdist worker's collection on 2 cores. This process only (the
# subprocesses the tests start keep the environment as it is); __pycache__ is ignored by git.
sys.dont_write_bytecode = False

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


# `make test` runs the suite in TEST_WORKERS pytest-xdist processes with `--dist loadscope`, where each test
# belongs to one group (below) and a group runs in one process, in order:
# - "slurm" and "slurm-b": tests/e2e, split in two by file (SLURM_B_FILES; the two about equally long).
#   Each group has a local Slurm cluster of its own (scripts/local-slurm.sh: "slurm" the default one,
#   "slurm-b" instance b; SLURM_INSTANCES), and its tests assume they own it (its partitions, its nodes'
#   processes, preemption between jobs); they run one after another, first, since they are the longest
#   chains and mostly wait on Slurm. Both go out first, one to each of two workers (--no-loadscope-reorder).
# - "netns": tests/bench. The WAN emulations create network namespaces with fixed names.
# - every other test file is its own group, so its module fixtures (a reference run, a clone) are built once.
# (xdist's own `loadgroup` marks do not group under pytest 9.2, which no longer reads Item._nodeid: the
# groups are made by the scheduler below, through xdist's public hook.)
_SERIAL_GROUPS = {"tests/e2e/": "slurm", "tests/bench/": "netns"}
# 2026-12-06, 3 workers: one make test's durations summed per file, less what three tests of the first and
# third file saved since (measured alone): slurm about 15.6 min, slurm-b about 15.0 with these four files
SLURM_B_FILES = {
    "tests/e2e/test_every_ending.py",
    "tests/e2e/test_example_trainer.py",
    "tests/e2e/test_run_dir_guards.py",
    "tests/e2e/test_stop_protocols.py",
}
SLURM_INSTANCES = {"slurm": "", "slurm-b": "b"}


def suite_group(nodeid: str) -> str:
    """The xdist group of a test, from its node id (relative to the repository root)."""
    path = nodeid.split("::", 1)[0]
    if path in SLURM_B_FILES:
        return "slurm-b"
    for prefix, name in _SERIAL_GROUPS.items():
        if nodeid.startswith(prefix):
            return name
    return path


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return suite_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    # in an xdist worker: the Slurm group first (make test passes --no-loadscope-reorder, so the groups go
    # out in collection order); a plain run keeps pytest's order
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: suite_group(item.nodeid) not in SLURM_INSTANCES)


_SLURM_INSTANCE = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # in an xdist worker, the first e2e test names the cluster of every e2e test of the process: a worker runs
    # one Slurm group (both go out first, one to each of two workers)
    group = suite_group(item.nodeid)
    if hasattr(item.config, "workerinput") and group in SLURM_INSTANCES:
        item.config.stash.setdefault(_SLURM_INSTANCE, SLURM_INSTANCES[group])


@pytest.fixture(scope="session")
def slurm_instance(pytestconfig) -> str:
    """The local-slurm.sh instance the e2e tests of this process use: under xdist that of their group
    (SLURM_INSTANCES), else SBATCH_GEN_SLURM_INSTANCE, else the default cluster ("")."""
    return pytestconfig.stash.get(_SLURM_INSTANCE, os.environ.get("SBATCH_GEN_SLURM_INSTANCE", ""))


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process (torch.distributed's in-memory store), for code that
    needs a group (FSDP2, DTensors, the sync's refusals); its DistInfo. Destroyed after the test."""
    import torch.distributed as dist

    from sbatch_gen.train.dist import DistInfo

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistInfo(is_distributed=True, backend="gloo")
    finally:
        dist.destroy_process_group()
