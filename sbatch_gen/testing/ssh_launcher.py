"""An SSH launcher's functions, for tests that run one of them (tests/render, tests/ssh)."""

from __future__ import annotations

import shlex
from pathlib import Path


def ssh_launcher_functions(script: Path) -> str:
    """An SSH launcher rendered at ``script`` without its last line (``main "$@"``), then what its main does
    first: the SSH library beside it sourced (pinned by sha256: pinned_library) and the launch's state set up
    (launch_setup: TAG, LOGS, NODE_PROGRAM, ...). Sourced by bash: every function the launcher runs, with its
    settings."""
    text = Path(script).read_text()
    assert text.endswith('\nmain "$@"\n'), script
    here = shlex.quote(str(Path(script).parent))
    return text[: -len('main "$@"\n')] + f'source "$(pinned_library {here})"\nlaunch_setup {here}\n'
