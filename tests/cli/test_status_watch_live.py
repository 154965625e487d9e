"""`sbatch-gen status --watch` on a terminal, against a live two-region run: the real trainer in two torchrun
regions on this machine meeting in an fs mailbox, the watch running in tmux, its screen read back with
capture-pane. Region us leaves through its stop file (a planned stop, as on preemption), then is started
again and rejoins; the screen shows it joined, then leaving and falling behind, then joined again."""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from xr.conftest import data_dir  # noqa: F401 - fixture, reused
from xr.test_multiproc import TIMEOUT, write_config

from sbatch_gen.testing.regions import RegionRun, launch_region
from sbatch_gen.testing.tmux import Tmux, status_rows
from sbatch_gen.xr_options import CrossRegion

from .conftest import write_site

pytestmark = pytest.mark.slow  # two torchrun regions of the real trainer, and tmux

REGIONS = ["eu", "us"]
# elastic (min_regions 1): eu goes on while us is away. grace_s is long, so that while both run a round does
# not close without a region that is slow to start on 2 shared cores.
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


def wait_screen(
    screen: Tmux, pred: Callable[[dict[str, list[str]], str], bool], what: str, runs: list[RegionRun]
) -> str:
    """Capture the pane until a whole screen satisfies ``pred(rows, screen)``; fail at once when a region
    exits, or after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    last = ""
    while time.monotonic() < deadline:
        for r in runs:
            assert r.poll() == [None], f"region {r.region} exited while waiting for {what}:\n{r.tail()}"
        text = screen.capture()
        rows = status_rows(text, REGIONS)
        if rows:
            last = text
            if pred(rows, text):
                return text
        time.sleep(0.1)
    raise AssertionError(f"no screen with {what} within {TIMEOUT} s; the last one:\n{last}")


def presence_round(cell: str) -> int:
    m = re.fullmatch(r"\w+ \(round (\d+)\)", cell)
    assert m, cell
    return int(m.group(1))


def test_status_watch_in_tmux_shows_a_region_leave_and_rejoin(tmp_path, repo, data_dir):  # noqa: F811
    assert shutil.which("tmux"), "tmux is not installed: make system-deps installs it"
    transport = {"kind": "fs", "root": str(tmp_path / "mailbox")}
    sites = tmp_path / "sites"
    write_site(sites, "eu", yaml.safe_dump({**XR, "region": "eu", "transport": transport}))
    cfg = write_config(tmp_path, repo, train={"steps": 100_000})  # eu trains until the test ends it

    def launch(region: str, attempt: int) -> RegionRun:
        return launch_region(
            CrossRegion(**XR, region=region, transport=transport),
            config=cfg,
            run_dir=tmp_path / region,
            data_path=data_dir,
            nproc=1,
            env={"SBATCH_GEN_TEST_STEP_SLEEP_S": "0.05"},
            extra_args=["--stop-file", str(tmp_path / f"{region}.stop.{attempt}")],
        )

    watch = [str(Path(sys.executable).parent / "sbatch-gen"), "status", "--site", "eu"]
    runs: list[RegionRun] = []
    with Tmux([*watch, "--sites-dir", str(sites), "--watch", "--interval", "0.2"]) as screen:
        try:
            runs += [launch("eu", 0), launch("us", 0)]
            eu, us = runs

            # 1. both joined, both in the newest round, both beating; and a snapshot
            def both_in(t, text):
                return all(
                    t[r][2].startswith("joined") and t[r][4] == "yes" and t[r][6] != "-" for r in REGIONS
                ) and (re.search(r"snapshot:  round \d+", text))

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
            assert status_rows(left, REGIONS)["eu"][3:5] == ["0", "yes"]
            assert re.search(r"by eu \(leave, waited [\d.]+ s for us\).*members: eu; absent: us", left), left
            left_at = presence_round(status_rows(left, REGIONS)["us"][2])

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
            assert "members: eu, us" in back, back
            assert re.search(
                r"by (eu \(all, waited [\d.]+ s for us|us \(all, waited [\d.]+ s for eu)\)", back
            ), back

            # Ctrl-C ends the watch, exit 0
            screen.keys("C-c")
            deadline = time.monotonic() + 30
            while "[exited" not in (text := screen.capture()):
                assert time.monotonic() < deadline, text
                time.sleep(0.1)
            assert "[exited 0]" in text and "Traceback" not in text, text
        finally:
            for r in runs:
                r.kill()
