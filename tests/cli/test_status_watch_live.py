"""`sbatch-gen status --watch` on a terminal, against a live two-region run: the real trainer in two torchrun
regions on this machine meeting in an fs mailbox, the watch running in tmux, its screen read back with
capture-pane. Region us leaves through its stop file (a planned stop, as on preemption), then is started
again and rejoins; the screen shows it joined, then leaving and falling behind, then joined again."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from xr.conftest import data_dir  # noqa: F401 - fixture, reused
from xr.test_multiproc import TIMEOUT, write_config

from sbatch_gen.testing.regions import RegionRun, launch_region
from sbatch_gen.xr_options import CrossRegion

from .conftest import write_site

pytestmark = pytest.mark.slow  # two torchrun regions of the real trainer, and tmux

REGIONS = ["eu", "us"]
# elastic (min_regions 1): eu goes on while us is away. grace_s is long so that no round closes without us
# while both run (start-up on 2 shared cores): every round us misses, it missed by its announced leave.
XR = dict(
    enabled=True,
    run_id="watch",
    regions=REGIONS,
    inner_steps=4,
    min_regions=1,
    grace_s=120,
    timeout_s=TIMEOUT,
    snapshot_every=2,
    shard_mb=0.05,
    threads=2,
)
FOOTER = "(* this site's region"  # the last line of a screen: a capture with it holds a whole read


class Screen:
    """The watch's tmux pane: a private tmux server (its own socket), one window 200 x 50."""

    def __init__(self, sock: Path, cmd: list[str]) -> None:
        self.sock = str(sock)
        # the shell around the watch keeps the pane open after it exits, with its exit code on screen
        line = shlex.join(cmd) + '; echo "[status --watch exited $?]"; sleep 600'
        self._tmux("new-session", "-d", "-s", "watch", "-x", "200", "-y", "50", line)

    def _tmux(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-S", self.sock, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"tmux {args[0]}: {r.stderr.strip()}"
        return r.stdout

    def capture(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "watch")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "watch", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True, timeout=30)


def rows(screen: str) -> dict[str, list[str]]:
    """The region table of a whole screen: region -> its cells (``region  last published  presence  behind
    in newest commit  presence updated  last heartbeat``)."""
    out = {}
    for line in screen.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0].rstrip(" *") in REGIONS and len(cells) == 7:
            out[cells[0].rstrip(" *")] = cells
    return out


def wait_screen(
    screen: Screen, pred: Callable[[dict[str, list[str]], str], bool], what: str, runs: list[RegionRun]
) -> str:
    """Capture the pane until a whole screen satisfies ``pred(rows, screen)``; fail at once when a region
    exits, or after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    last = ""
    while time.monotonic() < deadline:
        for r in runs:
            assert r.poll() == [None], f"region {r.region} exited while waiting for {what}:\n{r.tail()}"
        text = screen.capture()
        if FOOTER in text:
            last = text
            if pred(rows(text), text):
                return text
        time.sleep(0.1)
    raise AssertionError(f"no screen with {what} within {TIMEOUT} s; the last one:\n{last}")


def presence_round(cell: str) -> int:
    m = re.fullmatch(r"\w+ \(round (\d+)\)", cell)
    assert m, cell
    return int(m.group(1))


def test_status_watch_in_tmux_shows_a_region_leave_and_rejoin(tmp_path, repo, data_dir):  # noqa: F811
    assert shutil.which("tmux"), "tmux is not installed: make system-deps installs it"
    mailbox = tmp_path / "mailbox"
    transport = {"kind": "fs", "root": str(mailbox)}
    sites = tmp_path / "sites"
    write_site(sites, "eu", yaml.safe_dump({**XR, "region": "eu", "transport": transport}))
    cfg = write_config(tmp_path, repo, train={"steps": 100_000})  # eu trains until the test ends it
    env = {"SBATCH_GEN_STEP_SLEEP_S": "0.05"}

    def launch(region: str, attempt: int) -> RegionRun:
        return launch_region(
            CrossRegion(**XR, region=region, transport=transport),
            config=cfg,
            run_dir=tmp_path / region,
            data_path=data_dir,
            nproc=1,
            env=env,
            extra_args=["--stop-file", str(tmp_path / f"{region}.stop.{attempt}")],
        )

    watch = [str(Path(sys.executable).parent / "sbatch-gen"), "status", "--site", "eu"]
    watch += ["--sites-dir", str(sites), "--watch", "--interval", "0.2"]
    runs: list[RegionRun] = []
    with tempfile.TemporaryDirectory(prefix="sg-tmux-") as sockdir:  # a socket path must stay short
        screen = Screen(Path(sockdir) / "sock", watch)
        try:
            runs += [launch("eu", 0), launch("us", 0)]
            eu, us = runs

            # 1. both joined, both in the newest round, both beating; and a snapshot
            def both_in(t, text):
                return all(
                    t.get(r, [""] * 7)[2].startswith("joined") and t[r][4] == "yes" and t[r][6] != "-"
                    for r in REGIONS
                ) and re.search(r"snapshot:  round \d+", text)

            text = wait_screen(screen, both_in, "eu and us joined and in the newest round", runs)
            assert "members: eu, us" in text and "min_regions 1, grace 120 s, heartbeat every 5 s" in text

            # 2. us stops (its stop file): it announces its leave and exits 0; eu closes rounds without it
            (tmp_path / "us.stop.0").touch()
            left = wait_screen(
                screen,
                lambda t, _: t["us"][2].startswith("leaving") and t["us"][4] == "no" and int(t["us"][3]) >= 2,
                "us leaving, out of the newest round and 2 rounds behind",
                [eu],
            )
            assert us.wait(TIMEOUT) == [0], us.tail()
            assert rows(left)["eu"][3:5] == ["0", "yes"]
            assert re.search(r"by eu \(leave, waited [\d.]+ s for us\).*members: eu; absent: us", left), left
            left_at = presence_round(rows(left)["us"][2])

            # 3. us starts again: it catches up from the mailbox and takes part in eu's rounds again
            runs[1] = us = launch("us", 1)
            back = wait_screen(
                screen,
                lambda t, _: (
                    t["us"][2].startswith("joined")
                    and presence_round(t["us"][2]) > left_at
                    and t["us"][3:5] == ["0", "yes"]
                ),
                "us joined again, in the newest round",
                runs,
            )
            assert "members: eu, us" in back and re.search(
                r"by (eu \(all, waited [\d.]+ s for us|us \(all, waited [\d.]+ s for eu)\)", back
            ), back

            # Ctrl-C ends the watch, exit 0
            screen.keys("C-c")
            deadline = time.monotonic() + 30
            while "[status --watch exited" not in (text := screen.capture()):
                assert time.monotonic() < deadline, text
                time.sleep(0.1)
            assert "[status --watch exited 0]" in text and "Traceback" not in text, text
        finally:
            screen.close()
            for r in runs:
                r.kill()
