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
