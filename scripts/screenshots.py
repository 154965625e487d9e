"""The pictures of docs/watching.md, taken from a real run: ``make screenshots`` (which installs what this
needs first: chromium and tmux from apt, rich from the ``docs`` extra).

One tiny cross-region run on this machine: regions eu and us, each a torchrun of the real trainer with every
metric sink on (TensorBoard, W&B offline, the Prometheus textfile), meeting in an fs mailbox. While it
runs, ``sbatch-gen status --watch`` runs in tmux; us is stopped through its stop file (a planned leave, as
on preemption) and the watch's screen is captured while eu goes on without it; then us is started again,
rejoins, and both finish. Afterwards:

  status-watch.svg   the tmux screen of ``status --watch`` while us is away
  tensorboard.png    TensorBoard on both regions' event files, in headless chromium
  wandb-leet.svg     eu's offline W&B run in ``wandb leet`` (W&B's terminal UI), under tmux
  prometheus.svg     an excerpt of eu's Prometheus textfile

Terminal screens are rendered to SVG with rich. Nothing reaches beyond 127.0.0.1.

    python scripts/screenshots.py [--out docs/img] [--work DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from sbatch_gen.testing.procs import terminate  # noqa: E402
from sbatch_gen.testing.regions import RegionRun, launch_region  # noqa: E402
from sbatch_gen.testing.s3server import free_port  # noqa: E402
from sbatch_gen.testing.tmux import Tmux, status_rows  # noqa: E402
from sbatch_gen.xr_options import CrossRegion  # noqa: E402

BIN = Path(sys.executable).parent
RUN_ID = "llm-xr-1"
REGIONS = ["eu", "us"]
TIMEOUT_S = 300  # any one wait: a run, a screen, a server
# elastic (min_regions 1): eu goes on while us is away; grace_s long, so that while both run a round does not
# close without a region slow to start
XR = dict(
    enabled=True,
    run_id=RUN_ID,
    regions=REGIONS,
    inner_steps=10,
    min_regions=1,
    grace_s=120,
    snapshot_every=4,
    shard_mb=0.05,
    threads=2,
)
TB_TAGS = "^(loss|tokens_per_s|xr_total_s|xr_participants)$"
PROM_NAMES = ("step", "last_write_timestamp_seconds", "loss", "tokens_per_s", "xr_round", "xr_exposed_s")
PROM_NAMES += ("xr_participants", "xr_absent_regions")


def log(msg: str) -> None:
    print(f"screenshots: {msg}", flush=True)


def wait_until(pred, what: str, check=lambda: None, timeout_s: float = TIMEOUT_S):
    """Poll ``pred()`` until it returns something true; ``check()`` raises when waiting is pointless."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"screenshots: no {what} within {timeout_s:g} s")


def svg(screen: str, title: str, cols: int, path: Path) -> None:
    """A terminal screen (ANSI colours kept) as an SVG, through rich; no web fonts (the viewer's monospace)."""
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, width=cols, file=io.StringIO(), color_system="truecolor")
    lines = screen.rstrip("\n").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    console.print(Text.from_ansi("\n".join(lines)), no_wrap=True, overflow="crop")
    # rich names a web font by URL: dropped, so that a viewer uses its own monospace and fetches nothing
    text = re.sub(r"@font-face \{.*?\}\s*", "", console.export_svg(title=title, unique_id="sg"), flags=re.S)
    path.write_text(text)
    log(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


def write_inputs(work: Path, steps: int) -> tuple[Path, Path, Path]:
    """The train config (tiny, every sink on), the data, and a sites dir whose site eu names the run."""
    from sbatch_gen.train.data import prepare

    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["model"]["dropout"] = 0.0
    cfg["data"]["max_bytes"] = 400_000
    cfg["train"].update(steps=steps, log_every=1)
    cfg["checkpoint"]["every"] = 1000
    cfg["metrics"] = {"sinks": ["tensorboard", "wandb", "prometheus"], "prometheus_every": 10}
    cfg["metrics"]["wandb_project"] = "sbatch-gen-docs"
    config = work / "train.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    data = work / "data"
    prepare(data, REGIONS, source="python-stdlib", max_bytes=400_000)
    sites = work / "sites"
    sites.mkdir()
    xr = {**XR, "region": "eu", "transport": {"kind": "fs", "root": "mailbox"}}
    site = (REPO / "sites" / "local.yaml").read_text()
    (sites / "eu.yaml").write_text(site + "\n" + yaml.safe_dump({"cross_region": xr}, sort_keys=False))
    return config, data, sites


def launch(work: Path, config: Path, data: Path, region: str, attempt: int) -> RegionRun:
    xr = CrossRegion(**XR, region=region, transport={"kind": "fs", "root": str(work / "mailbox")})
    return launch_region(
        xr,
        config=config,
        run_dir=work / region,
        data_path=data,
        nproc=1,
        # offline W&B, whatever this shell holds; steps slowed so that the run outlasts us's restart
        env={"WANDB_MODE": "offline", "WANDB_API_KEY": "", "SBATCH_GEN_TEST_STEP_SLEEP_S": "0.05"},
        log_dir=work / "logs",
        extra_args=["--stop-file", str(work / f"{region}.stop.{attempt}")],
    )


def running(*runs: RegionRun):
    def check() -> None:
        for r in runs:
            if r.poll() != [None]:
                raise SystemExit(f"screenshots: region {r.region} exited early:\n{r.tail()}")

    return check


def watch_a_leave(work: Path, config: Path, data: Path, sites: Path, out: Path) -> None:
    """The run, with us away for a while; the status screen captured while eu trains alone."""
    cols = 150
    cmd = [str(BIN / "sbatch-gen"), "status", "--site", "eu", "--sites-dir", str(sites), "--watch"]
    runs: list[RegionRun] = []
    with Tmux([*cmd, "--interval", "1"], cols=cols, rows=13, cwd=work) as screen:
        try:
            runs += [launch(work, config, data, r, 0) for r in REGIONS]
            eu, us = runs
            log("eu and us training; waiting for both in round 5")

            def both_in() -> bool:  # a few rounds in, so that the picture is of a run under way
                t = status_rows(screen.capture(), REGIONS)
                newest = re.fullmatch(r"round (\d+)", t["eu"][1]) if t else None
                return bool(newest) and int(newest[1]) >= 5 and all(t[r][4] == "yes" for r in REGIONS)

            wait_until(both_in, "round 5 with eu and us", running(eu, us))
            (work / "us.stop.0").touch()
            log("us stopped through its stop file; waiting until the watch shows it 2 rounds behind")

            def away() -> str | None:
                text = screen.capture()
                t = status_rows(text, REGIONS)
                return text if t and t["us"][2].startswith("leaving") and int(t["us"][3]) >= 2 else None

            svg(
                wait_until(away, "screen with us away", running(eu)),
                "sbatch-gen status --watch",
                cols,
                out / "status-watch.svg",
            )
            if us.wait(TIMEOUT_S) != [0]:
                raise SystemExit(f"screenshots: us did not stop cleanly:\n{us.tail()}")
            runs[1] = us = launch(work, config, data, "us", 1)
            log("us started again; waiting for both to finish")
            for r in runs:
                if r.wait(TIMEOUT_S) != [0]:
                    raise SystemExit(f"screenshots: region {r.region} failed:\n{r.tail()}")
        finally:
            for r in runs:
                r.kill()


def tensorboard(work: Path, out: Path, steps: int) -> None:
    """TensorBoard on both regions' event files (as docs/watching.md starts it), in headless chromium."""
    port = free_port()
    spec = ",".join(f"{r}:{work / r / 'tensorboard'}" for r in REGIONS)
    url = f"http://127.0.0.1:{port}"
    with open(work / "logs" / "tensorboard.log", "wb") as f:
        tb = subprocess.Popen(
            [str(BIN / "tensorboard"), "--logdir_spec", spec, "--host", "127.0.0.1", "--port", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:

        def loaded() -> bool:  # every run's loss up to the last step
            try:
                tags = get_json(f"{url}/data/plugin/scalars/tags")
                if len(tags) != len(REGIONS):
                    return False
                q = urllib.parse.urlencode
                return all(
                    get_json(f"{url}/data/plugin/scalars/scalars?{q({'run': run, 'tag': 'loss'})}")[-1][1]
                    == steps
                    for run in tags
                )
            except (OSError, ValueError, IndexError):  # not up yet, or the run not loaded yet
                return False

        def alive() -> None:
            if tb.poll() is not None:
                raise SystemExit(f"screenshots: tensorboard exited {tb.returncode}: see {f.name}")

        wait_until(loaded, "TensorBoard serving both runs", alive)
        page = f"{url}/#scalars&_smoothingWeight=0&tagFilter={urllib.parse.quote(TB_TAGS, safe='')}"
        chromium(page, out / "tensorboard.png", (1400, 740), work / "chromium")
    finally:
        terminate(tb)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def chromium(url: str, png: Path, size: tuple[int, int], profile: Path) -> None:
    """A screenshot of ``url`` in headless chromium (its own profile dir; ``--no-sandbox``: it runs as root)."""
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    cmd += [f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=30000"]
    r = subprocess.run([*cmd, f"--screenshot={png}", url], capture_output=True, text=True, timeout=TIMEOUT_S)
    if r.returncode != 0 or not png.exists():
        raise SystemExit(f"screenshots: chromium exited {r.returncode}:\n{r.stderr[-2000:]}")
    log(f"wrote {png} ({png.stat().st_size // 1024} KiB)")


def wandb_leet(work: Path, out: Path) -> None:
    """eu's offline W&B run in ``wandb leet``, once its screen is drawn and stays the same."""
    (run,) = (work / "eu" / "wandb").glob("offline-run-*")
    cols = 160
    with Tmux([str(BIN / "wandb"), "leet", str(run)], cols=cols, rows=45, cwd=work) as screen:
        last = ""

        def drawn() -> str | None:  # the run read, its charts drawn, and the same screen twice in a row
            nonlocal last
            text, before = screen.capture(ansi=True), last
            last = text
            ready = all(x in screen.capture() for x in ("State: Finished", "Metrics [", "Summary [", "│loss"))
            return text if ready and text == before else None

        svg(
            wait_until(drawn, "wandb leet screen"),
            "wandb leet RUN_DIR/wandb/offline-run-*",
            cols,
            out / "wandb-leet.svg",
        )


def prometheus(work: Path, out: Path) -> None:
    """An excerpt of eu's textfile: a few gauges with their help lines, as grep prints them."""
    (prom,) = (work / "eu").glob("sbatch_gen_*.prom")
    names = "|".join(PROM_NAMES)
    cmd = ["grep", "-E", f"^(# HELP )?sbatch_gen_({names})\\b", str(prom.relative_to(work))]
    r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, check=True)
    cols = max(len(line) for line in [shlex.join(cmd), *r.stdout.splitlines()]) + 2
    svg(f"$ {shlex.join(cmd)}\n{r.stdout}", "the Prometheus textfile", cols, out / "prometheus.svg")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="where the pictures go")
    ap.add_argument("--work", type=Path, default=None, help="the run's directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=300, help="training steps of each region")
    args = ap.parse_args(argv)
    for tool in ("tmux", "chromium"):
        if shutil.which(tool) is None:
            raise SystemExit(f"screenshots: {tool} is not installed (make screenshots installs it)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        raise SystemExit(f"screenshots: --work {args.work}: not empty (the run starts afresh)")
    with tempfile.TemporaryDirectory(prefix="sbgen-shots-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        config, data, sites = write_inputs(work, args.steps)
        watch_a_leave(work, config, data, sites, args.out)
        tensorboard(work, args.out, args.steps)
        wandb_leet(work, args.out)
        prometheus(work, args.out)


if __name__ == "__main__":
    main()
