"""Every benchmark runs end to end in --quick mode and writes a well-formed result (never timings)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.common import Result, md_table
from bench.render import imported_modules

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _failure(p: subprocess.CompletedProcess) -> str:
    """What a failed benchmark printed: the start of each traceback (a region's log in the exception's text
    would push it out of a plain tail), then the tails."""
    heads = [p.stderr[m.start() : m.start() + 1500] for m in re.finditer(r"^Traceback", p.stderr, re.M)]
    return "\n".join(
        [*heads, "--- stdout tail ---", p.stdout[-2000:], "--- stderr tail ---", p.stderr[-2000:]]
    )


def _bench(name: str, out: Path, *extra: str, timeout: float = 900) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "bench", name, "--quick", "--out", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, _failure(p)
    md = (out / f"{name}.md").read_text()
    data = json.loads((out / f"{name}.json").read_text())
    assert data["name"] == name and data["quick"] is True
    assert md.startswith("# ") and "## Setup" in md and "--quick" in md
    for t in data["tables"].values():  # every table: a header and rows of the same width
        assert t["rows"], t
        assert all(len(r) == len(t["headers"]) for r in t["rows"])
    for m in re.finditer(r"\]\(([\w.-]+\.png)\)", md):
        assert (out / m.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "README.md").read_text()
    assert f"[{name}]({name}.md)" in summary
    return data


def _table(data: dict, key: str) -> tuple[list[str], list[list]]:
    t = data["tables"][key]
    return t["headers"], t["rows"]


def test_outer_quick(tmp_path):
    d = _bench("outer", tmp_path)
    headers, rows = _table(d, "outer")
    assert rows[0][0].startswith("xr round") and rows[1][0].startswith("in-place reference")
    by = {r[0]: r for r in rows}
    nest = by.get("xr `outer_nesterov_` alone (flat buffers)")
    if nest is not None:  # counted by the dispatch-mode byte counter: 3 reads + 2 writes minimum
        assert nest[headers.index("bytes/param as executed")] >= 20
    _, bw = _table(d, "bandwidth")
    diff = dict((r[0], r[1]) for r in bw)["max abs difference, theta (xr) vs theta (reference)"]
    assert diff < 1e-4  # the reference really computes the same update as the trainer's code


def test_render_quick_never_imports_torch(tmp_path):
    d = _bench("render", tmp_path)
    _, rows = _table(d, "imports")
    assert dict((r[0], r[1]) for r in rows)["torch modules imported"] == 0
    assert d["goals"][0]["met"] is True


def test_ddp_quick(tmp_path):
    d = _bench("ddp", tmp_path, timeout=1200)
    _, strag = _table(d, "straggler")
    assert [r[0] for r in strag] == [0.0, 0.1]
    assert strag[1][3] == 1  # the trainer names rank 1 as the slowest
    _, scaling = _table(d, "scaling")
    assert scaling[0][0] == 2


def test_diloco_quick(tmp_path):
    d = _bench("diloco", tmp_path, timeout=1200)
    _, rows = _table(d, "variants")
    grad, dil = rows
    assert grad[0].startswith("grad") and dil[0] == "DiLoCo H=4"
    assert grad[1] == 8 and dil[1] == 2  # rounds: every step vs every 4th of 8
    assert grad[3] == pytest.approx(4 * dil[3], rel=0.01)  # 4x the bytes for 4x the rounds


def test_elastic_quick(tmp_path):
    """Real regions: b crashes and comes back; elastic a keeps training, strict a waits; b absent from rounds
    of a scripted run. Behaviour only: who missed which rounds, how the rounds closed, bitwise-equal models."""
    from bench.elastic import QUICK

    d = _bench("elastic", tmp_path, timeout=600)
    headers, rows = _table(d, "goodput")
    by = {r[0].split(",")[0].split(" ")[0]: dict(zip(headers, r, strict=True)) for r in rows}
    elastic, strict = by["elastic"], by["strict"]
    missed = {k: int(v["rounds b missed"].split()[0]) for k, v in by.items()}
    assert missed["elastic"] >= 1 and missed["strict"] == 0  # strict never closes a round without b
    assert elastic["a's rounds"] == strict["a's rounds"] == QUICK.g_steps // QUICK.g_h
    # the survivor's wait in a round b missed is bounded by grace_s (plus one poll), never the timeout
    assert elastic["wait max s (missed rounds)"] <= QUICK.g_grace_s + 1.0
    headers, rows = _table(d, "quality")
    base, away, control = (dict(zip(headers, r, strict=True)) for r in rows)
    # the control: b stays in the run and trains every step, but withholds its deltas in rounds q_first+1..;
    # those rounds close without it (more may, in a run this short: b's start-up can leave it behind a, which
    # it then fast-forwards past), and b ends bitwise equal to a
    withheld = set(range(QUICK.q_first + 1, QUICK.q_first + QUICK.q_withhold + 1))
    assert "(control)" in control["variant"] and withheld <= {int(x) for x in control["which"].split(",")}
    assert control["a's steps"] == QUICK.q_steps and control["a == b bitwise"] is True
    assert base["rounds b missed"] == "0%" and base["which"] == "-"
    missed = [int(x) for x in away["which"].split(",")]
    # b left after round q_first; it missed a contiguous stretch from there (when it rejoined depends on timing)
    assert missed == list(range(QUICK.q_first + 1, missed[-1] + 1)), missed
    assert away["b's steps"] < base["b's steps"] and away["a's steps"] == base["a's steps"] == QUICK.q_steps
    assert (
        base["a == b bitwise"] is True and away["a == b bitwise"] is True
    )  # the returning b fast-forwarded exactly
    assert all(r[headers.index("held-out loss")] > 0 for r in rows)


def test_mailbox_quick(tmp_path):
    from bench.wan import available

    d = _bench("mailbox", tmp_path, timeout=1500)
    keys = ["fs", "s3"] + (["wan"] if available() is None else [])
    for k in keys:
        headers, rows = _table(d, k)
        assert rows[0][0] == 1 and rows[0][1] == 0.5  # 1 MiB of fp32 params -> 0.5 MiB of bf16 per region
        assert all(r[headers.index("ours s")] > 0 and r[headers.index("ceiling s")] > 0 for r in rows)


def test_md_table_escapes_pipes():
    t = md_table(["a", "b"], [["x|y", 1.23456]])
    assert t.splitlines()[2] == "| x\\|y | 1.23 |"


def test_result_files(tmp_path):
    r = Result("demo", "Demo", quick=True)
    r.table("T", ["k", "v"], [["a", 1]], "t")
    r.goal("g", "1", True)
    r.write(tmp_path)
    assert "| g | 1 | yes |" in (tmp_path / "demo.md").read_text()
    assert json.loads((tmp_path / "demo.json").read_text())["tables"]["t"]["rows"] == [["a", 1]]


def test_importtime_parser():
    err = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:       120 |        120 |   _io\n"
        "import time:      3000 |      90000 | torch\n"
        "import time:        50 |         50 |     torch._C\n"
    )
    assert imported_modules(err) == ["_io", "torch", "torch._C"]


def test_delay_proxy_delays_and_keeps_bytes():
    """Bytes come through intact, and a request/response costs at least one RTT."""
    from sbatch_gen.testing.s3server import free_port

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def echo():
        c, _ = srv.accept()
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    lport = free_port()
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.delayproxy",
            "--listen",
            f"127.0.0.1:{lport}",
            "--target",
            f"127.0.0.1:{port}",
            "--rtt-ms",
            "200",
            "--window-kb",
            "64",
        ],
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", lport), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "proxy did not listen"
                time.sleep(0.05)
        payload = bytes(range(256)) * 2048  # 512 KiB: 8 windows of 64 KiB
        t0 = time.monotonic()
        with c:
            c.settimeout(60)
            c.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = c.recv(65536)
                assert chunk
                got += chunk
        elapsed = time.monotonic() - t0
        assert got == payload
        # >= connection set-up RTT + 8 windows' worth of RTTs, each way bounded below by the window
        assert elapsed >= 0.2 * 8
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        srv.close()


def test_payload_quick(tmp_path):
    """Real regions per payload dtype (fs, and the emulated WAN where it runs): the bytes on the wire are exactly
    the documented sizes (int8/fp8 half of bf16, int4 a quarter, plus one fp32 scale per 256 values), the same over every
    transport, and every dtype trains to bit-identical regions with a held-out loss. Never timings."""
    from bench.payload import QUICK, expected_bytes
    from bench.wan import available

    d = _bench("payload", tmp_path, timeout=900)
    headers, rows = _table(d, "bytes")
    by = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    assert list(by) == ["fp32", "bf16", "int8", "fp8", "int4"]
    numel = by["fp32"]["bytes up per round"] // 4
    for dtype, row in by.items():
        assert row["bytes up per round"] == row["expected"] == expected_bytes(dtype, numel)[0]
        assert row["exact"] is True
        on_wan = dtype in ("bf16", "int8")  # a quick run sends only those over the WAN
        assert all(row[h] is (True if on_wan else "-") for h in headers if h.startswith("same on"))
    assert ("same on wan" in headers) == (available() is None)
    bf16, int8 = by["bf16"]["bytes up per round"], by["int8"]["bytes up per round"]
    assert bf16 == 2 * numel and by["fp32"]["bytes up per round"] == 2 * bf16
    assert int8 == by["fp8"]["bytes up per round"] == bf16 // 2 + by["int8"]["of which scales"]
    assert by["int8"]["of which scales"] == 4 * -(-numel // 256)  # one shard at this size
    int4 = by["int4"]["bytes up per round"]
    assert int4 == -(-numel // 2) + by["int4"]["of which scales"] and by["int4"]["of which scales"] == 4 * -(
        -numel // 256
    )
    assert d["goals"][0]["met"] is True and d["goals"][1]["met"] is True
    for where, labels in [("fs", list(by))] + ([("wan", ["bf16", "int8"])] if available() is None else []):
        h, rs = _table(d, where)
        assert [r[0] for r in rs] == labels and all(r[h.index("round s (median)")] > 0 for r in rs)
        assert all(r[h.index("bytes up = expected")] is True and r[h.index("shards")] == 1 for r in rs)
    headers, rows = _table(d, "quality")
    q = [dict(zip(headers, r, strict=True)) for r in rows]
    assert [(x["payload"], x["seed"]) for x in q] == [
        (t, s) for s in QUICK.q_seeds for t in ("bf16", "int8", "fp8", "int4")
    ]
    assert all(x["rounds"] == QUICK.q_steps // QUICK.q_h and x["a == b bitwise"] is True for x in q)
    assert all(float(x["held-out loss"]) > 0 for x in q)
    up = {x["payload"]: x["MB up (a, whole run)"] for x in q}
    assert up["int8"] == up["fp8"] and 0.5 < up["int8"] / up["bf16"] < 0.52
    assert 0.25 < up["int4"] / up["bf16"] < 0.27


def test_overlap_accounting():
    """bench/overlap's figures from a region's metrics records: every ``xr_exposed_s`` counts (eager's first
    boundary, which closes no round, and the ``xr_final_round`` event included), wall time is the steps' time."""
    import dataclasses

    from bench.overlap import QUICK, V, _region_figures

    sz = dataclasses.replace(QUICK, h=2, rounds=2)

    def step(i: int, **kw) -> dict:
        return {"step": i, "step_time_s": 1.0, **kw}

    def rnd(r: int, exposed: float, **kw) -> dict:
        out = {"xr_round": r, "xr_total_s": 0.5, "xr_exposed_s": exposed, "xr_outer_step_s": 0.01}
        return {**out, "xr_bytes_up": 100, **kw}

    none = [step(1), step(2, **rnd(1, 0.5, xr_cleanup_s=0.0)), step(3), step(4, **rnd(2, 0.4))]
    f = _region_figures("none", none, sz, V("none", "bf16"))
    assert f["exposed_s"] == pytest.approx(0.9) and f["exposed_final_s"] == 0.0
    assert f["wall_s"] == 4.0 and f["bytes_up"] == 100 and f["round_s"] == [0.5, 0.5]
    first = {"xr_step": 2, "xr_inflight": 1, "xr_join_s": 0.0, "xr_exposed_s": 0.05}
    final = {"event": "xr_final_round", "step": 4, **rnd(2, 0.45, xr_join_s=0.4, xr_final=True)}
    eager = [step(1), step(2, **first), step(3), step(4, **rnd(1, 0.06, xr_join_s=0.01)), final]
    f = _region_figures("eager", eager, sz, V("eager", "bf16"))
    assert f["exposed_s"] == pytest.approx(0.56) and f["exposed_final_s"] == 0.45
    assert f["exposed_each"] == [0.05, 0.06, 0.45] and f["join_s"] == [0.0, 0.01, 0.4]
    with pytest.raises(RuntimeError, match="rounds"):  # the round in flight at the end must be accounted
        _region_figures("eager", eager[:-1], sz, V("eager", "bf16"))
    with pytest.raises(RuntimeError, match="xr_final_round"):  # none never has one
        _region_figures("none", eager, sz, V("none", "bf16"))


def test_overlap_accounting_streaming():
    """Streaming (F 2, tau 1, H 4): a round starts every 2 steps and merges a step later; the starts, the
    merges and the final event (the last round, merged after the last step) all count; the rounds' bytes
    differ by fragment: the largest is the peak, the sum the run's."""
    import dataclasses

    from bench.overlap import QUICK, V, _region_figures

    sz = dataclasses.replace(QUICK, h=4, rounds=2)
    v = V("streaming", "bf16", 2, 1)

    def step(i: int, **kw) -> dict:
        return {"step": i, "step_time_s": 1.0, **kw}

    def start(k: int) -> dict:
        return {"xr_inflight": k, "xr_fragment": (k - 1) % 2, "xr_exposed_s": 0.01}

    def merge(k: int, **kw) -> dict:
        up = 60 if k % 2 else 40
        rec = {
            "xr_round": k,
            "xr_total_s": 0.5,
            "xr_exposed_s": 0.1,
            "xr_join_s": 0.08,
            "xr_outer_step_s": 0.01,
        }
        return {**rec, "xr_bytes_up": up, **kw}

    recs = [step(1), step(2, **start(1)), step(3, **merge(1)), step(4, **start(2)), step(5, **merge(2))]
    recs += [step(6, **start(3)), step(7, **merge(3)), step(8, **start(4))]
    recs.append({"event": "xr_final_round", "step": 8, **merge(4, xr_exposed_s=0.3, xr_final=True)})
    f = _region_figures("s", recs, sz, v)
    assert f["exposed_s"] == pytest.approx(4 * 0.01 + 3 * 0.1 + 0.3) and f["exposed_final_s"] == 0.3
    assert f["start_each"] == [0.01] * 4 and f["merge_each"] == [0.1] * 3
    assert f["bytes_up"] == 60 and f["bytes_up_total"] == 200 and f["wall_s"] == 8.0
    with pytest.raises(RuntimeError, match="xr_final_round"):  # tau 0 leaves nothing in flight at the end
        _region_figures("s", recs, sz, V("streaming", "bf16", 2, 0))
    with pytest.raises(RuntimeError, match="boundaries"):  # a round start that was not accounted
        _region_figures("s", [step(1), step(2), *recs[2:]], sz, v)


def test_quality_plan_covers_the_issue():
    """bench quality's full sweep (not run here: ~25 min): H 10/50/100 with at least 20 rounds at the largest H,
    a grid holding the defaults and plain averaging, and one run directory per variant; the best grid point per
    H is picked from bf16 runs without overlap only."""
    from dataclasses import replace

    from bench.quality import DEFAULT_LR, DEFAULT_MOMENTUM, FULL, PLAIN, Variant, best_per_h

    assert FULL.hs == (10, 50, 100) and FULL.steps // max(FULL.hs) >= 20
    assert {(DEFAULT_LR, DEFAULT_MOMENTUM), PLAIN} <= set(FULL.grid) and FULL.payload_h in FULL.hs
    grid = [Variant("diloco", h, lr, m) for h in FULL.hs for lr, m in FULL.grid]
    plan = [Variant("grad"), Variant("single"), *grid]
    plan += [replace(v, overlap="eager") for v in grid] + [replace(v, dtype="int8") for v in grid]
    assert len({v.key for v in plan}) == len(plan)
    # streaming (issue 26): F 2 and 4, tau 1, 5 and H/F - 1, at H 50 and 100, over the whole grid
    from bench.quality import stream_configs

    assert stream_configs(FULL) == [
        (50, 2, 1),
        (50, 2, 5),
        (50, 2, 24),
        (50, 4, 1),
        (50, 4, 5),
        (50, 4, 11),
        (100, 2, 1),
        (100, 2, 5),
        (100, 2, 49),
        (100, 4, 1),
        (100, 4, 5),
        (100, 4, 24),
    ]

    def rec(v: Variant, loss: float) -> dict:
        return {
            "kind": v.kind,
            "h": v.h,
            "dtype": v.dtype,
            "overlap": v.overlap,
            "heldout": loss,
            "key": v.key,
        }

    a, b = Variant("diloco", 10, *PLAIN), Variant("diloco", 10, DEFAULT_LR, DEFAULT_MOMENTUM)
    runs = [
        rec(a, 2.0),
        rec(b, 2.1),
        rec(replace(b, overlap="eager"), 1.0),
        rec(replace(b, dtype="int8"), 1.0),
    ]
    assert best_per_h(runs, (10,))[10]["key"] == a.key


def test_peer_quick(tmp_path):
    """torchft and ours on the same work: without overlap ours (fp32 payload) trains the same model, step by
    step, as torchft does (the comparison is of the same work, not of two trainers); the fault runs end with
    both replicas completed and one model between them."""
    d = _bench("peer", tmp_path)
    headers, rows = _table(d, "runs")
    col = {h: headers.index(h) for h in headers}
    by = {(r[col["system"]], r[col["payload"]], r[col["overlap"]].split()[0]): r for r in rows}
    assert set(by) == {(s, "fp32", o) for s in ("torchft", "ours") for o in ("none", "streaming")}
    gap = float(by["ours", "fp32", "none"][col["training loss vs torchft's (largest gap)"]])
    assert gap < 1e-4, gap
    held = {s: float(by[s, "fp32", "none"][col["held-out loss"]]) for s in ("torchft", "ours")}
    assert abs(held["torchft"] - held["ours"]) < 1e-3, held
    # strict rounds end on the same model in both replicas (torchft's streaming ends on each one's own mix)
    for key in [("torchft", "fp32", "none"), ("ours", "fp32", "none"), ("ours", "fp32", "streaming")]:
        assert by[key][col["a == b"]] == "identical", key
    fh, faults = _table(d, "faults")
    fc = {h: fh.index(h) for h in fh}
    assert sorted(r[fc["system"]] for r in faults) == ["ours", "torchft"]
    for r in faults:
        assert (
            r[fc["fault"]] == "one"
            and r[fc["ended (seconds after the fault)"]] == "a: completed, b: completed"
        ), r
        assert r[fc["catch-up"]] != "-" and r[fc["a == b"]] in ("identical", "differ"), r
    goals = [g["goal"] for g in d["goals"]]
    assert any("fault one" in g for g in goals) and any("none: wall time" in g for g in goals)
    assert all(g["met"] is None for g in d["goals"])  # --quick judges nothing


def test_sinks_quick(tmp_path):
    """The sink benchmark runs the trainer with and without the sinks, each placement (shared CPUs, and the
    sinks pinned to a CPU of their own), and the runs with sinks wrote all three; then each sink alone in
    the sinks' process. Its ratios are measurements, never asserted."""
    from bench.sinks import CONTROL, MODES

    d = _bench("sinks", tmp_path)
    headers, rows = _table(d, "pairs")
    want = ["placement", "pair", "sinks started at step", "steady from step", "steady: no sinks"]
    want += ["steady: all sinks", "steady: all / none", "start-up: no sinks", "start-up: all sinks"]
    want += ["start-up: all / none", "CPU s, no sinks", "CPU s, all sinks"]
    assert MODES == ("shared", "pinned")  # this machine has 2 CPUs
    assert headers == want and [r[0] for r in rows] == list(MODES)
    for row in rows:
        started, cut = row[2:4]
        assert isinstance(started, int) and cut == started + 501
        assert all(v != v for v in row[4:7])  # nan: 40 steps end before a steady state
        assert all(isinstance(v, float) and v > 0 for v in row[7:])
    headers, rows = _table(d, "per_record")
    assert [r[0] for r in rows] == ["tensorboard", "wandb", "prometheus", "all three"]
    goals = {g["goal"]: g for g in d["goals"]}
    assert goals["every 'all' run's sinks wrote"]["met"] is True
    assert sum(g["goal"].startswith("all sinks cost < 1%") for g in d["goals"]) == 2
    headers, rows = _table(d, "toggled")
    assert [r[0] for r in rows] == [*MODES, CONTROL]
    assert all(r[headers.index("turns")] >= 2 for r in rows)  # the sinks were stopped and continued
    waits = headers.index("trainer's run-queue wait per step (us), running turns")
    assert all(r[waits] != r[waits] for r in rows)  # nan: no turn after the sinks' start in 400 steps


def test_turns_compare_each_running_turn_with_its_stopped_neighbours():
    """bench sinks' within-run comparison: a running turn's median over the mean of the stopped turns either
    side (a drift cancels); turns before the steady state and a turn's first steps are left out."""
    from bench.sinks import TURN_GUARD, _turns

    # steps 1-100 stopped at 1 ms, then turns of 100 steps: stopped 1.0 ms, running 1.1 ms, stopped 1.2 ms,
    # running 1.3 ms, stopped 1.4 ms; each turn's first steps (a record a step late) at 9 ms
    times, marks = [0.001] * 100, []
    for k, ms in enumerate([1.0, 1.1, 1.2, 1.3, 1.4]):
        times += [0.009] * TURN_GUARD + [ms / 1e3] * (100 - TURN_GUARD)
        marks.append((k % 2 == 1, 100 + 100 * k))  # (running from here, the last step logged then)
    marks.append((True, 600))  # the end of the last turn
    assert _turns(times, marks, after=50) == pytest.approx([1.1 / 1.1, 1.3 / 1.3])
    assert _turns(times, marks, after=250) == pytest.approx([1.3 / 1.3])  # the turn from step 200 on


def test_the_pinner_moves_every_thread_below_a_process_to_its_cpu():
    """bench sinks' pinned placement: a grandchild and its threads end up on the pinner's CPU, the process
    it watches (the trainer's place) stays where it was."""
    from bench.sinks import _Pinner

    # the watched process starts a child, which starts a grandchild; each has a second thread
    sleeper = "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
    grandchild = sleeper + "time.sleep(30)"
    child = sleeper + f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    pinner = _Pinner(proc.pid, {1})
    pinner.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            kids = _descendants_threads(proc.pid)
            if len(kids) >= 4 and all(os.sched_getaffinity(t) == {1} for t in kids):
                break  # the child and its thread, the grandchild and its thread
            assert time.monotonic() < deadline, {t: os.sched_getaffinity(t) for t in kids}
            time.sleep(0.05)
        assert os.sched_getaffinity(proc.pid) == os.sched_getaffinity(0)  # the watched process: untouched
    finally:
        pinner.done()
        proc.kill()
        proc.wait()


def test_queue_waits_are_per_step_and_apart_for_running_and_stopped_turns():
    from bench.sinks import _queue_waits

    # (running from here, last step, run-queue wait s): a turn before step 100 is left out
    marks = [(True, 50, 0.0), (False, 100, 1.0), (True, 200, 1.001), (False, 300, 1.005), (True, 500, 1.007)]
    assert _queue_waits(marks, after=60) == pytest.approx((40.0, 10.0))  # 4 ms / 100, 3 ms / 300 steps


def _descendants_threads(pid: int) -> list[int]:
    from sbatch_gen.proc import descendants

    out = []
    for child in descendants(pid):
        try:
            out += [int(t.name) for t in Path(f"/proc/{child}/task").iterdir()]
        except OSError:
            pass
    return out


def test_fsdp_quick(tmp_path):
    """Every run went to the end; the fields the comparison rests on are there, and the outer state per rank
    is what the sharding says: the DDP leader all of it, each FSDP rank its half (never timings)."""
    from bench.fsdp import DDP, MIXED, MMAP, PHASES, RUNS

    d = _bench("fsdp", tmp_path, timeout=900)
    headers, rows = _table(d, "runs")
    by = {(r[0], r[1]): dict(zip(headers, r, strict=True)) for r in rows}
    assert sorted(by) == sorted(RUNS) and len(rows) == len(RUNS)  # one repetition in --quick
    for (variant, _), row in by.items():
        mib = [float(x) for x in row["outer MiB/rank, a"].split(" / ")]
        ddp = float(by[(DDP, MMAP)]["outer MiB/rank, a"].split(" / ")[0])
        assert mib == ([ddp, 0.0] if variant == DDP else [pytest.approx(ddp / 2, rel=0.01)] * 2)
        assert all(float(x) > 100 for x in row["peak RSS MiB/rank, a"].split(" / "))  # every rank sampled
        assert row["total_s"] > 0 and row["MiB up"] > 0 and row["step s"] > 0
        assert all(row[p.removeprefix("xr_")] >= 0 for p in PHASES)
        assert (row["FSDP comm s/step"] > 0) == (variant != DDP)
        if variant != DDP:
            assert row["broadcast_s"] == 0  # a sharded region broadcasts nothing after the outer step
    assert float(by[(MIXED, RUNS[2][1])]["outer MiB/rank, b"]) == pytest.approx(ddp)  # DDP x1: all of it
    for key in ("ratios", "ratios_mmap"):
        ratios = dict((r[0], r[1]) for r in _table(d, key)[1])
        assert ratios["outer state, the rank holding most"] == pytest.approx(0.5, rel=0.01)


def test_sparse_quick(tmp_path):
    """Grad mode, dense bf16 and sparse DiLoCo side by side: both regions end on the same model in every
    variant, and a sparse round uploads a small share of bf16's bytes (never timings; --quick judges nothing)."""
    d = _bench("sparse", tmp_path, timeout=600)
    headers, rows = _table(d, "variants")
    by = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    assert len(by) == 3 and all(r["a, b identical"] == "yes" for r in by.values())
    assert by["grad (every step)"]["vs grad"] == "+0.00%"
    ((h, *side),) = _table(d, "side")[1]
    assert h.startswith("4 (") and len(side) == 3  # grad, best dense bf16, sparse 3%
    sparse = next(r for label, r in by.items() if "sparse 3.0%" in label)
    assert sparse["objects vs bf16"].startswith("1/") and int(sparse["objects vs bf16"][2:]) > 20
    assert all(g["met"] is None for g in d["goals"])


def test_sparse_scale_quick(tmp_path):
    """One round per payload through the real exchange: bf16 puts 2 bytes per parameter on the wire, sparse
    exactly its format's bytes (whole chunks of 4096, each header + indices + codes), each plus a manifest."""
    import math

    from sbatch_gen.train.xr.protocol import sparse_chunk_nbytes
    from sbatch_gen.train.xr.sparse import kept

    d = _bench("sparse_scale", tmp_path, timeout=300)
    rows = {r["label"]: r for r in d["data"]["rows"]}
    assert list(rows) == ["bf16", "sparse 1%", "sparse 3%"]
    numel = rows["bf16"]["numel"]
    assert rows["bf16"]["count"] == 1 and rows["bf16"]["objects"] == 2 * numel  # one shard below 16 MiB
    for label, density in (("sparse 1%", 0.01), ("sparse 3%", 0.03)):
        r = rows[label]
        assert r["objects"] == math.ceil(numel / 4096) * sparse_chunk_nbytes(4096, kept(4096, density)), label
        assert 0 < r["manifest"] < 2000 and r["vs_bf16"] < 0.05
    assert all(g["met"] is None for g in d["goals"])
