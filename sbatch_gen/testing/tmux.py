"""A terminal program under tmux, its screen read back: how the tests and ``scripts/screenshots.py`` watch
``sbatch-gen status --watch`` as an operator would. Torch-free; needs the ``tmux`` binary (apt).

Each :class:`Tmux` is a private tmux server on its own socket, ended with ``kill-server`` on that socket:
nothing touches another tmux server of this machine.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
from pathlib import Path

# the last line of a `status` screen (sbatch_gen/cli.py, _format_status): a capture holding it holds a whole
# read, since a redraw clears the screen first and writes the table top-down
STATUS_FOOTER = "(* this site's region"
STATUS_COLUMNS = 7  # region, last published, presence, behind, in newest commit, presence updated, heartbeat


class Tmux:
    """``cmd`` running in a detached ``cols`` x ``rows`` window. When ``cmd`` exits, the pane stays, with
    ``[exited N]`` on its last line (a shell around it prints that, then sleeps until :meth:`close`)."""

    def __init__(
        self, cmd: list[str], cols: int = 200, rows: int = 50, cwd: str | Path | None = None
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sg-tmux-")  # a socket path must stay short
        self.sock = str(Path(self._dir.name) / "sock")
        line = shlex.join(cmd) + '; echo "[exited $?]"; sleep 3600'
        where = ["-c", str(cwd)] if cwd is not None else []
        try:
            self._tmux("new-session", "-d", "-s", "main", "-x", str(cols), "-y", str(rows), *where, line)
        except BaseException:
            self._dir.cleanup()
            raise

    def _tmux(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-S", self.sock, *args], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"tmux {args[0]}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def capture(self, ansi: bool = False) -> str:
        """The visible screen; ``ansi``: with its colours and attributes as escape sequences."""
        return self._tmux("capture-pane", "-p", *(["-e"] if ansi else []), "-t", "main")

    def keys(self, *keys: str) -> None:
        """Type ``keys`` (tmux key names: ``C-c``, ``q``, ``Enter``)."""
        self._tmux("send-keys", "-t", "main", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True, timeout=30)
        self._dir.cleanup()

    def __enter__(self) -> Tmux:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def status_rows(screen: str, regions: list[str]) -> dict[str, list[str]]:
    """The region table of a whole ``sbatch-gen status`` screen: region -> its cells (see STATUS_COLUMNS;
    the site's own region without its `` *``). Empty when ``screen`` is not a whole read."""
    if STATUS_FOOTER not in screen:
        return {}
    rows = {}
    for line in screen.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0].rstrip(" *") in regions and len(cells) == STATUS_COLUMNS:
            rows[cells[0].rstrip(" *")] = cells
    return rows
