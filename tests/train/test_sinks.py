"""The metric sinks (sbatch_gen/train/sinks.py), fed by their own process (sbatch_gen/train/sinkproc.py)
through the trainer's MetricsWriter: the scalars a record gives, the tail read of metrics.jsonl, a failing
sink, each sink read back with its project's own reader (tests/train/readback.py), the sinks' process
following a cut line and outliving no trainer, and the whole trainer with every sink on, stopped and
resumed."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.proc import pid_alive
from sbatch_gen.train import sinkproc, sinks
from sbatch_gen.train.metrics import MetricsWriter
from sbatch_gen.train.sinkproc import Tail
from sbatch_gen.train.sinks import Sinks, last_logged_step, scalars

from .readback import prometheus_samples, tensorboard_scalars, wandb_scalars

pytestmark = pytest.mark.slow  # imports tensorboard and wandb (seconds each); wandb starts its service

STEP = {
    "step": 7,
    "loss": 3.5,
    "lr": 1e-3,
    "tokens": 96,
    "tokens_per_s": 1000.0,
    "step_time_s": 0.02,
    "data_time_s": 0.001,
    "comm_time_s": None,
    "grad_norm": 1.5,
    "mem_bytes": 123,
    "mfu": None,
    "hfu": None,
    "slowest_rank": 1,
    "rank_losses": [3.4, 3.6],
}
ROUND = {
    "xr_round": 2,
    "xr_upload_s": 0.1,
    "xr_total_s": 0.5,
    "xr_exposed_s": 0.25,
    "xr_bytes_up": 1000,
    "xr_members": ["eu", "us"],
    "xr_absent": ["ap"],
    "xr_late": False,
}


def test_scalars_of_a_step_a_round_and_events():
    step, vals = scalars(STEP)
    assert step == 7
    assert vals == {
        "loss": 3.5,
        "lr": 1e-3,
        "tokens_per_s": 1000.0,
        "step_time_s": 0.02,
        "data_time_s": 0.001,
        "slowest_rank": 1.0,
        "grad_norm": 1.5,
        "mem_bytes": 123.0,
    }
    _, vals = scalars({**STEP, **ROUND})
    assert vals["xr_participants"] == 2 and vals["xr_absent_regions"] == 1 and vals["xr_late"] == 0
    assert vals["xr_exposed_s"] == 0.25 and vals["xr_round"] == 2
    _, final = scalars({"event": "xr_final_round", "step": 9, **ROUND, "xr_late": True})
    assert "loss" not in final and final["xr_late"] == 1 and final["xr_total_s"] == 0.5
    assert scalars({"event": "xr_align", "step": 0}) is None
    assert scalars({"time": 1.0, "event": "xr_outer_state"}) is None
    assert math.isnan(scalars({**STEP, "loss": float("nan")})[1]["loss"])


def test_last_logged_step_reads_the_tail(tmp_path):
    p = tmp_path / "metrics.jsonl"
    assert last_logged_step(p) is None
    lines = [json.dumps({"step": i, "loss": 1.0, "pad": "x" * 300}) for i in range(1, 2001)]
    lines.append(json.dumps({"time": 1.0, "event": "xr_leave", "step": 5000}))
    p.write_text("\n".join(lines) + "\n")
    assert last_logged_step(p, chunk=1000) == 2000  # many chunks, lines cut at chunk edges
    assert last_logged_step(p, chunk=1000, end=len("\n".join(lines[:700])) + 1) == 700  # before a byte
    p.write_text(json.dumps({"time": 1.0, "event": "xr_align"}) + "\n")
    assert last_logged_step(p) is None


class _Boom:
    name = "boom"

    def __init__(self):
        self.calls = 0

    def write(self, step, values):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def close(self):
        raise AssertionError("a disabled sink is not closed")


class _Keep:
    name = "keep"

    def __init__(self):
        self.got = []
        self.closed = False

    def write(self, step, values):
        self.got.append((step, values["loss"]))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_a_failing_sink_is_disabled_with_one_warning(caplog):
    boom, keep = _Boom(), _Keep()
    s = Sinks({"boom": lambda: boom, "keep": lambda: keep})
    with caplog.at_level(logging.WARNING, logger="sbatch_gen.train"):
        for i in range(1, 6):
            s.write({**STEP, "step": i})
        s.close()
    assert boom.calls == 1 and keep.got == [(i, 3.5) for i in range(1, 6)] and keep.closed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "metrics sink boom failed (OSError: [Errno 28] No space left on device): disabled; "
        "metrics.jsonl is unaffected"
    ]


def _feed(run_dir, opts, records, first_step=1):
    """An attempt that logs ``records`` with the sinks of ``opts`` on, as the trainer's rank 0 does: they
    are in every sink once it closed."""
    w = MetricsWriter(run_dir / "metrics.jsonl")
    w.open_sinks(opts, run_id="run/1", region="eu", first_step=first_step)
    proc = w.sinks
    assert proc is not None
    for r in records:
        w.write(r)
    w.close()
    assert proc.proc.returncode == 0


def _lines(err: str) -> list[str]:
    """The sinks' lines of a log."""
    return [line.split("] ", 1)[1] for line in err.splitlines() if "] metrics sink" in line]


def _warnings(err: str) -> list[str]:
    """... but the one that says when they started."""
    return [line for line in _lines(err) if not STARTED.match(line)]


STARTED = re.compile(r"metrics sinks (\S+(?:, \S+)*) started in [\d.]+ s, metrics.jsonl at step (\d+|None)$")


def test_every_sink_reads_back_the_same_values(tmp_path, monkeypatch):
    """The last records are in every sink as soon as the writer closed."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    opts = MetricsOptions(sinks=["tensorboard", "wandb", "prometheus"], prometheus_every=2)
    records = [{**STEP, "step": i, "loss": 4.0 - i / 8} for i in range(1, 6)]
    records[2].update(ROUND)
    for r in records:  # a GPU run's: the time shares, and the telemetry of two ranks
        r.update(time_share_fwd_bwd=0.8, DCGM_FI_DEV_GPU_UTIL=[87.0, 90.0 + r["step"]])
    _feed(tmp_path, opts, records)
    want = {}
    for r in records:
        step, vals = scalars(r)
        for k, v in vals.items():
            want.setdefault(k, {})[step] = v
    tb = tensorboard_scalars(tmp_path)
    assert tb.keys() == want.keys()
    for k in want:
        assert tb[k] == pytest.approx(want[k], rel=1e-6)  # TensorBoard stores float32
    wb, runs = wandb_scalars(tmp_path)
    assert wb == want
    assert [(r.run_id, r.run_group, r.display_name) for r in runs] == [("run_1-eu", "run/1", "eu")]
    prom = prometheus_samples(tmp_path / "sbatch_gen_run_1_eu.prom")
    labels, v = prom["sbatch_gen_loss"]
    assert labels == {"run_id": "run/1", "region": "eu"} and v == records[-1]["loss"]
    assert prom["sbatch_gen_step"][1] == 5 and prom["sbatch_gen_xr_participants"][1] == 2
    assert "DCGM_FI_DEV_GPU_UTIL/rank1" in tb and "time_share_fwd_bwd" in tb
    assert prom["sbatch_gen_DCGM_FI_DEV_GPU_UTIL"] == ({"run_id": "run/1", "region": "eu", "rank": "1"}, 95.0)


def test_a_resumed_attempt_continues_the_runs_without_a_step_twice(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    opts = MetricsOptions(sinks=["tensorboard", "wandb"])
    _feed(tmp_path, opts, [{**STEP, "step": i, "loss": float(i)} for i in range(1, 8)])
    # the second attempt resumes from the checkpoint of step 4: steps 5-7 are done again, then 8-10; its
    # sinks start at the end of the first attempt's metrics.jsonl
    _feed(tmp_path, opts, [{**STEP, "step": i, "loss": float(i) + 0.5} for i in range(5, 11)], first_step=5)
    tb = tensorboard_scalars(tmp_path)["loss"]
    assert tb == {**{i: float(i) for i in range(1, 5)}, **{i: i + 0.5 for i in range(5, 11)}}  # purged
    wb, runs = wandb_scalars(tmp_path)
    assert wb["loss"] == {**{i: float(i) for i in range(1, 8)}, **{i: i + 0.5 for i in range(8, 11)}}
    assert [r.run_id for r in runs] == ["run_1-eu", "run_1-eu"]  # one run, continued


def test_a_fresh_start_over_a_used_run_dir_purges_tensorboard_from_step_1(tmp_path):
    opts = MetricsOptions(sinks=["tensorboard"])
    _feed(tmp_path, opts, [{**STEP, "step": i, "loss": float(i)} for i in range(1, 8)])
    # --resume none (or no checkpoint yet): the next attempt trains from step 1 again, and stops sooner
    _feed(tmp_path, opts, [{**STEP, "step": i, "loss": i + 0.5} for i in range(1, 4)])
    assert tensorboard_scalars(tmp_path)["loss"] == {i: i + 0.5 for i in range(1, 4)}


def test_a_sink_that_fails_on_its_first_write_is_left_out_with_one_warning_line(tmp_path, capfd):
    blocked = tmp_path / "ro"
    blocked.write_text("a file where the Prometheus directory should be")
    opts = MetricsOptions(sinks=["prometheus"], prometheus_dir=str(blocked / "d"), prometheus_every=1)
    _feed(tmp_path, opts, [{**STEP, "step": i} for i in range(1, 4)])
    warnings = _warnings(capfd.readouterr().err)  # the sinks' process writes to the trainer's stderr
    assert len(warnings) == 1 and warnings[0].startswith("metrics sink prometheus failed ("), warnings
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_wandb_unreachable_is_left_out_without_holding_training_up(tmp_path, monkeypatch, capfd):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    opts = MetricsOptions(sinks=["wandb", "prometheus"], wandb_init_timeout_s=5)
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    t0 = time.monotonic()
    w.open_sinks(opts, run_id="run/1", region="eu", first_step=1)
    w.write(STEP)
    assert time.monotonic() - t0 < 1  # training does not wait for W&B
    w.close()
    warnings = _warnings(capfd.readouterr().err)
    assert len(warnings) == 1 and warnings[0].startswith("metrics sink wandb not started ("), warnings
    assert "x" * 40 not in warnings[0]
    assert prometheus_samples(tmp_path / "sbatch_gen_run_1_eu.prom")["sbatch_gen_step"][1] == 7


def test_the_tail_waits_for_a_line_s_end_and_skips_a_cut_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_bytes(b'{"event": "before"}\n{"step": 1}\n{"step": 2, "lo')
    tail = Tail(p, len(b'{"event": "before"}\n'))  # this attempt's start
    assert tail.read() == [{"step": 1}]
    with open(p, "ab") as f:  # step 2's line ends; step 3's is cut by a crash, and step 4 appended to it
        f.write(b'ss": 2.0}\n{"step": 3, "lo{"step": 4}\n{"step": 5}\n')
    assert tail.read() == [{"step": 2, "loss": 2.0}, {"step": 5}]
    assert tail.read() == []


def test_the_trainer_says_when_the_sinks_did_not_finish_in_time(tmp_path, caplog):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.open_sinks(MetricsOptions(sinks=["prometheus"]), run_id="r", region="eu", first_step=1)
    assert w.sinks is not None
    proc = w.sinks
    w.write({"step": 1, "loss": 1.0})
    with caplog.at_level(logging.WARNING, logger="sbatch_gen.train"):
        assert proc.close(timeout=0) is False  # it has not even started its sinks yet
    assert [r.getMessage() for r in caplog.records] == [
        f"metrics sinks (pid {proc.pid}) still writing after 0 s: not waiting for them; the last records "
        "may be missing from them (metrics.jsonl is complete)"
    ]
    assert proc.proc.wait(60) == 0  # it finishes alone
    assert _prom_step(tmp_path / "sbatch_gen_r_eu.prom") == 1


# A trainer's rank 0 (MetricsWriter) with the Prometheus sink: logs steps 1-3, says its sinks' pid, waits
# for a line on stdin, logs step 4 and SIGKILLs itself.
_KILLED = """
import os, signal, sys
from pathlib import Path
from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.train.metrics import MetricsWriter

w = MetricsWriter(Path(sys.argv[1]) / "metrics.jsonl")
w.open_sinks(MetricsOptions(sinks=["prometheus"], prometheus_every=1), run_id="r", region="eu", first_step=1)
for i in range(1, 4):
    w.write({"step": i, "loss": float(i)})
print(w.sinks.pid, flush=True)
sys.stdin.readline()
w.write({"step": 4, "loss": 4.0})
os.kill(os.getpid(), signal.SIGKILL)
"""


def _until(what, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while not (got := what()):
        assert time.monotonic() < end, f"not within {deadline_s} s: {what}"
        time.sleep(0.05)
    return got


def _prom_step(path: Path) -> float | None:
    try:
        return prometheus_samples(path)["sbatch_gen_step"][1]
    except (FileNotFoundError, KeyError):
        return None


def test_the_sinks_process_writes_the_last_records_and_exits_when_the_trainer_is_killed(tmp_path):
    prom = tmp_path / "sbatch_gen_r_eu.prom"
    trainer = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert trainer.stdout is not None and trainer.stdin is not None
    pid = int(trainer.stdout.readline())
    try:
        _until(lambda: _prom_step(prom) == 3)  # it follows the file while the trainer runs
        assert pid_alive(pid)
        trainer.stdin.write("go\n")
        trainer.stdin.close()
        assert trainer.wait(60) == -signal.SIGKILL
        _until(lambda: not pid_alive(pid))  # no orphan
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert _prom_step(prom) == 4  # what the trainer logged before it died reached the sink


def test_the_sinks_process_ignores_the_stop_signals(tmp_path):
    """Slurm signals every process of the step: the trainer stops on it, the sinks' process waits for the
    trainer's end to write the last records."""
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.open_sinks(
        MetricsOptions(sinks=["prometheus"], prometheus_every=1), run_id="r", region="eu", first_step=1
    )
    assert w.sinks is not None
    proc = w.sinks.proc
    w.write({"step": 1, "loss": 1.0})
    _until(lambda: _prom_step(tmp_path / "sbatch_gen_r_eu.prom") == 1)  # started, handlers installed
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(proc.pid, sig)
    w.write({"step": 2, "loss": 2.0})
    w.close()
    assert proc.returncode == 0 and _prom_step(tmp_path / "sbatch_gen_r_eu.prom") == 2


def test_the_sinks_module_imports_no_sink_package():
    # the packages are imported by the sink that needs them, so a run without sinks needs none of them
    for mod in (sinks, sinkproc):
        src = Path(mod.__file__ or "").read_text()
        top = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in top if any(p in line for p in ("wandb", "tensorboard", "prometheus"))]


def test_the_trainer_writes_every_sink_and_a_resume_continues_them(tmp_path, data_dir, clean_env):
    """A tiny run with every sink on, cut after step 6, its last checkpoint (6) lost, resumed from step 4
    and stopped (a stop file: checkpoint 6), resumed again to the end: each sink holds what metrics.jsonl
    holds, every step once, in one TensorBoard run and one W&B run (three attempts of the same id)."""
    import shutil

    from sbatch_gen.train.checkpoint import step_dir
    from sbatch_gen.train.cli import parse_args
    from sbatch_gen.train.spec import RunSpec
    from sbatch_gen.train.trainer import run

    from .conftest import read_metrics, write_config

    clean_env.pop("WANDB_API_KEY", None)
    cfg = write_config(
        tmp_path / "c.yaml",
        train={"steps": 8, "log_every": 1},
        checkpoint={"every": 4},
        metrics={"sinks": ["tensorboard", "wandb", "prometheus"], "prometheus_every": 3},
    )
    rd = tmp_path / "run"

    def train(*extra):
        args = ["--config", str(cfg), "--run-dir", str(rd), "--data-path", str(data_dir), *extra]
        assert run(RunSpec.from_args(parse_args(args))) == 0

    train("--max-steps", "6")
    shutil.rmtree(step_dir(rd, 6))  # as if the job died after step 6, before that checkpoint
    stop = tmp_path / "stop"
    stop.write_text("preempted\n")  # read at the end of the attempt's second step: 6
    train("--stop-file", str(stop))
    assert json.loads((tmp_path / "stop.ack").read_text())["step"] == 6
    stop.unlink()
    (tmp_path / "stop.ack").unlink()
    train()
    jsonl = read_metrics(rd)  # a step logged twice keeps its last record
    assert sorted(jsonl) == list(range(1, 9))
    want: dict[str, dict[int, float]] = {}
    for rec in jsonl.values():
        step, vals = scalars(rec)
        for k, v in vals.items():
            want.setdefault(k, {})[step] = v
    assert {"loss", "lr", "tokens_per_s", "step_time_s", "mem_bytes"} <= want.keys()
    tb = tensorboard_scalars(rd)
    assert tb.keys() == want.keys()
    for k in want:
        assert tb[k] == pytest.approx(want[k], rel=1e-6), k
    wb, runs = wandb_scalars(rd)
    assert wb.keys() == want.keys()
    for k in want:  # steps 5 and 6 were trained twice: W&B keeps the first attempt's (timings differ)
        assert {s: v for s, v in wb[k].items() if s not in (5, 6)} == {
            s: v for s, v in want[k].items() if s not in (5, 6)
        }, k
        assert wb[k].keys() == want[k].keys(), k
    for k in ("loss", "lr", "grad_norm"):  # bit for bit the same in both attempts
        assert wb[k] == want[k], k
    assert [(r.run_id, r.run_group, r.display_name) for r in runs] == [("run-local", "run", "local")] * 3
    prom = prometheus_samples(rd / "sbatch_gen_run_local.prom")
    assert prom["sbatch_gen_step"][1] == 8 and prom["sbatch_gen_loss"][1] == jsonl[8]["loss"]
    # `sbatch-gen report` reads the same run dir (metrics.jsonl; the sinks' files beside it are left alone),
    # and compares it with a baseline of the same region: the directories tell the two apart
    from sbatch_gen.report import write_report

    shutil.copytree(rd, tmp_path / "base" / "run")
    shutil.copytree(rd, tmp_path / "later" / "run")
    md = write_report([tmp_path / "base" / "run", tmp_path / "later" / "run"], tmp_path / "cmp")
    slo = json.loads((tmp_path / "cmp" / "slo.json").read_text())
    assert sorted(slo) == ["local (base/run)", "local (later/run)"], sorted(slo)
    assert "local (base/run)" in md.read_text()


@pytest.mark.parametrize(
    "before, after",
    [
        (b"", b""),
        (b'{"step": 1}\n', b'{"step": 1}\n'),
        (b'{"step": 1}\n{"step": 2, "lo', b'{"step": 1}\n'),
        (b'{"step": 1, "lo', b""),
    ],
)
def test_a_record_cut_by_a_kill_is_dropped_before_the_next_attempt_appends(tmp_path, before, after, caplog):
    """A trainer killed mid-write leaves its last record without a newline: the next attempt's writer cuts
    the file back to its last complete line (and says so in its log), instead of gluing its first record
    onto it."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(before)
    with caplog.at_level(logging.WARNING, logger="sbatch_gen.train"):
        w = MetricsWriter(path)
    w.write({"step": 9})
    w.close()
    assert path.read_bytes() == after + b'{"step": 9}\n'
    said = [
        f"metrics: {path}: dropped a cut last record ({len(before) - len(after)} bytes) left by a process "
        "killed mid-write"
    ]
    assert [r.getMessage() for r in caplog.records] == (said if before != after else [])
