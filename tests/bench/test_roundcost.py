"""`python -m bench roundcost --quick`: 2 regions as processes, the delay proxy in front of nanio, two tiny
payloads; the result's shape (never its timings)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.roundcost import fit

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # processes, a server and a proxy: ~20 s


def test_fit_recovers_a_line():
    a, b = fit([(0.25, 1.0 + 0.25 * 0.5), (4, 1.0 + 4 * 0.5), (16, 1.0 + 16 * 0.5)])
    assert math.isclose(a, 1.0) and math.isclose(b, 0.5)


def test_roundcost_quick(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "bench", "roundcost", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((tmp_path / "roundcost.json").read_text())
    md = (tmp_path / "roundcost.md").read_text()
    assert d["name"] == "roundcost" and d["quick"] is True
    assert md.startswith("# ") and "## Setup" in md and "--quick" in md
    assert "[roundcost](roundcost.md)" in (tmp_path / "README.md").read_text()
    for t in d["tables"].values():
        assert t["rows"] and all(len(r) == len(t["headers"]) for r in t["rows"]), t
    fit_t = d["tables"]["fit"]
    h = fit_t["headers"]
    # one row per variant and N: the trainer as shipped, and with botocore's Expect: 100-continue put back
    assert [(r[h.index("variant")], r[h.index("regions")]) for r in fit_t["rows"]] == [
        ("as shipped", 2),
        ("PUTs with Expect: 100-continue (botocore's default)", 2),
    ]
    for r in fit_t["rows"]:
        assert isinstance(r[h.index("fixed in RTT")], float) and isinstance(r[h.index("s per MiB")], float)
    rows = d["tables"]["per_size"]["rows"]
    assert [r[2] for r in rows] == [0.0625, 0.25, 0.0625, 0.25]  # MiB per region, per variant
    # every region's every round, measured or warm-up; the last region's rounds are the fitted ones
    rounds = d["data"]["rounds"]
    assert len(rounds) == 2 * 2 * 2 * 3  # variants x regions x sizes x (1 warm-up + 2 measured)
    last = [r for r in rounds if r["last"] and not r["warmup"]]
    assert len(last) == 2 * 2 * 2 and all(r["region"] == "us" for r in last)
    for r in last:
        assert r["requests"] == sum(r["by_op"].values()) > 0, r
        assert sorted(r["members"]) == ["eu", "us"], r
        assert r["xr_bytes_up"] == r["size"] and r["xr_bytes_down"] == r["size"], r  # bf16, one peer
    an = d["data"]["analysis"]["as shipped"]["2"]
    assert set(an) >= {"fixed_s", "fixed_rtt", "s_per_mib", "sizes"} and len(an["sizes"]) == 2
    assert all(g["met"] is None for g in d["goals"])  # a quick run judges nothing
