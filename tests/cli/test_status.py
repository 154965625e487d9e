"""`sbatch-gen status --site NAME`: a cross-region run's state, read from a real mailbox (a directory, or a
bucket on the local S3 server) that the real protocol classes wrote."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict

import pytest
import yaml

from sbatch_gen.train.xr import leave
from sbatch_gen.train.xr.commit import Commit, Member, Presence
from sbatch_gen.train.xr.heartbeat import Heartbeat, HeartbeatWriter
from sbatch_gen.train.xr.membership import Membership, manifest_digest
from sbatch_gen.train.xr.protocol import Mailbox, Manifest, ShardInfo, round_tag
from sbatch_gen.train.xr.store import FsStore, S3Store
from sbatch_gen.xr_options import CrossRegion, to_argv

from .conftest import KEY_ENV, REPO, SECRET_ENV, sg, write_secrets, write_site

RUN, REGIONS = "t-run", ["eu", "us", "ap"]
XR = """enabled: true
run_id: t-run
region: eu
regions: [eu, us, ap]
min_regions: 2
grace_s: 30
timeout_s: 600
"""


def _publish(store, region: str, r: int, numel: int = 2, nbytes: int = 8) -> Manifest:
    mb = Mailbox(store, RUN, region, REGIONS, threads=1)
    try:
        tag = round_tag(r)
        ((nbytes, dig),) = mb.upload_shards(tag, {0: b"\0" * nbytes}).values()
        m = Manifest(
            RUN,
            region,
            tag,
            "delta",
            r * 100,
            "fp32",
            numel,
            "layout",
            "raw",
            1000,
            [ShardInfo(0, 0, numel, nbytes, dig)],
        )
        store.put(mb.manifest_key(tag, region), m.to_json())
        return m
    finally:
        mb.close()


def _membership(store, region: str) -> Membership:
    return Membership(
        Mailbox(store, RUN, region, REGIONS, threads=1), quorum=2, grace_s=30, job=f"job-{region}"
    )


def _commit(store, r: int, manifests: dict[str, Manifest], closed_by: str, reason: str, stale=()) -> None:
    ms = _membership(store, closed_by)
    members = {k: Member(manifest_digest(m), m.tokens) for k, m in manifests.items()}
    c = Commit(
        RUN,
        round_tag(r),
        r * 100,
        members,
        closed_by,
        reason,
        12.5,
        [x for x in REGIONS if x not in manifests],
        time.time() - 90,
        stale=list(stale),
    )
    assert store.create(ms.commit_key(round_tag(r)), c.to_json())
    ms.mb.close()


def build_mailbox(store) -> None:
    """Round 40 with everyone; us announced a leave after it; rounds 41 and 42 closed without us
    (reason "leave"); a complete snapshot of round 40; ap never wrote a presence record. Heartbeats: eu's
    writer has just beaten twice, us's last one is 10 minutes old (by us's clock), ap has none."""
    r40 = {x: _publish(store, x, 40) for x in REGIONS}
    _commit(store, 40, r40, "eu", "all")
    ms = _membership(store, "us")
    ms.announce("leaving", 40, 4000)
    ms.complete_snapshot(40, {"theta": r40["eu"], "momentum": r40["us"]}, 40)
    ms.mb.close()
    for r in (41, 42):
        _commit(
            store, r, {x: _publish(store, x, r) for x in ("eu", "ap")}, "ap" if r == 42 else "eu", "leave"
        )
    # eu's presence record is three minutes old (written as Membership.announce writes it)
    ms = _membership(store, "eu")
    old = Presence("eu", "joined", 38, 3800, time.time() - 185, "job-eu")
    store.put(ms.presence_key("eu"), json.dumps(asdict(old)).encode())
    writer = HeartbeatWriter(store, ms.alive_key("eu"), "eu", 5.0, "job-eu")
    writer.beat()
    writer.beat()
    store.put(ms.alive_key("us"), Heartbeat("us", "x1", 41, 5.0, time.time() - 605, "job-us").to_json())
    ms.mb.close()


def _table(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0].rstrip(" *") in REGIONS and len(cells) >= 5:
            rows[cells[0].rstrip(" *")] = cells
    return rows


def test_status_table_from_an_fs_mailbox(tmp_path, sites):
    mbx = tmp_path / "mailbox"
    build_mailbox(FsStore(mbx))
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert "t-run" in out and f"fs:{mbx}" in out
    assert re.search(
        r"committed: round 42 \(step 4200\), closed 9\ds ago by ap \(leave, waited 12.5 s for us\), 0.0 s after the round before; "
        r"members: eu, ap; absent: us",
        out,
    ), out
    assert "snapshot:  round 40" in out
    rows = _table(out)
    assert set(rows) == set(REGIONS), out
    #    region  last published  presence  behind  in newest commit  presence updated  last heartbeat
    assert rows["us"][1:5] == ["round 40", "leaving (round 40)", "2", "no"]
    assert rows["us"][5].endswith("s ago (job job-us)") and rows["us"][6] == "10m ago (#41)"
    assert rows["eu"][1:6] == ["round 42", "joined (round 38)", "0", "yes", "3m ago (job job-eu)"]
    assert re.fullmatch(r"[01]s ago \(#2\)", rows["eu"][6]), rows["eu"]
    assert rows["ap"][1:7] == ["round 42", "absent", "0", "yes", "-", "-"]
    assert rows["eu"][0] == "eu *"  # this site's region
    assert "min_regions 2, grace 30 s, heartbeat every 5 s" in out
    assert "ages of heartbeats use the writing region's clock" in out


def test_status_shows_a_sparse_runs_density_and_bytes(tmp_path, sites):
    """payload_dtype sparse: one line with the wire dtype, the share of each chunk sent, and the bytes of
    each region's newest manifest against bf16's (the test's manifests: 8 bytes of 2 elements)."""
    mbx = tmp_path / "mailbox"
    build_mailbox(FsStore(mbx))
    xr = XR + "payload_dtype: sparse\nsparse_density: 0.03\n"
    write_site(sites, "eu", xr + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert (
        "payload:   sparse-c4096-k123 (3.00% of each chunk); newest round: eu 8 B, us 8 B, ap 8 B "
        "(2 of bf16's 4 B)" in out
    ), out
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites), "--json")
    pl = json.loads(out)["payload"]
    assert pl["bytes"] == {"eu": 8, "us": 8, "ap": 8} and pl["dtype"] == "sparse-c4096-k123"


def test_status_compares_each_regions_sparse_bytes_with_its_own_fragment_under_streaming(tmp_path, sites):
    """overlap streaming: eu has published round 43 (another fragment: 6 elements, 40 bytes) while us and
    ap are at rounds 40 and 42 (2 elements, 8 bytes): each region's bytes against its own round's payload
    in bf16 (eu 40 / 12, the others 8 / 4), not against one region's fragment."""
    mbx = tmp_path / "mailbox"
    build_mailbox(FsStore(mbx))
    _publish(FsStore(mbx), "eu", 43, numel=6, nbytes=40)
    xr = XR + "inner_steps: 100\noverlap: streaming\nfragments: 4\npayload_dtype: sparse\n"
    write_site(sites, "eu", xr + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert "newest round: eu 40 B, us 8 B, ap 8 B (at most 3.33 of bf16's, each against its own" in out, out
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites), "--json")
    pl = json.loads(out)["payload"]
    assert pl["bf16"] == {"eu": 12, "us": 4, "ap": 4} and pl["bf16_bytes"] == 12


def test_status_names_the_fragment_of_the_newest_round_under_streaming(tmp_path, sites):
    mbx = tmp_path / "mailbox"
    build_mailbox(FsStore(mbx))
    xr = XR + "inner_steps: 100\noverlap: streaming\nfragments: 4\n"
    write_site(sites, "eu", xr + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert "committed: round 42 (step 4200, fragment 1 of 4), closed" in out  # round k: fragment (k-1) mod F
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites), "--json")
    st = json.loads(out)
    assert st["fragments"] == 4 and st["newest_commit"]["fragment"] == 1


def test_status_json(tmp_path, sites):
    mbx = tmp_path / "mailbox"
    build_mailbox(FsStore(mbx))
    write_site(
        sites, "us", XR.replace("region: eu", "region: us") + f"transport: {{kind: fs, root: '{mbx}'}}\n"
    )
    code, out, err = sg("status", "--site", "us", "--sites-dir", str(sites), "--json")
    assert code == 0, err
    st = json.loads(out)
    assert st["run_id"] == RUN and st["site_region"] == "us" and st["quorum"] == 2
    assert st["newest_commit"]["round"] == 42 and st["newest_commit"]["members"] == ["eu", "ap"]
    assert st["newest_commit"]["absent"] == ["us"] and st["newest_commit"]["reason"] == "leave"
    assert st["committed_rounds"] == [40, 41, 42] and st["newest_snapshot"] == 40
    us = next(r for r in st["regions"] if r["region"] == "us")
    assert us["presence"] == "leaving" and us["behind"] == 2 and us["in_newest_commit"] is False
    assert us["last_published"] == 40 and us["job"] == "job-us"
    eu = next(r for r in st["regions"] if r["region"] == "eu")
    assert 180 <= eu["presence_age_s"] < 300
    assert eu["heartbeat"] == 2 and eu["heartbeat_interval_s"] == 5.0 and eu["heartbeat_age_s"] < 60
    assert us["heartbeat"] == 41 and 600 <= us["heartbeat_age_s"] < 700 and st["heartbeat_s"] == 5.0
    ap = next(r for r in st["regions"] if r["region"] == "ap")
    assert ap["heartbeat"] is None and ap["heartbeat_age_s"] is None


def test_status_names_the_regions_a_round_closed_without_for_a_stale_heartbeat(tmp_path, sites):
    mbx = tmp_path / "mailbox"
    store = FsStore(mbx)
    build_mailbox(store)
    _commit(store, 43, {x: _publish(store, x, 43) for x in ("eu", "us")}, "eu", "stale", stale=["ap"])
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert re.search(
        r"committed: round 43 .* by eu \(stale, waited 12.5 s for ap\), 0.0 s after the round before; members: eu, us; absent: ap "
        r"\(heartbeat stale: ap\)",
        out,
    ), out
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites), "--json")
    assert json.loads(out)["newest_commit"]["stale"] == ["ap"]


def test_status_names_whom_a_round_with_everyone_waited_for(tmp_path, sites):
    """A round every region took part in: its closer waited, after publishing, for the last of the others."""
    mbx = tmp_path / "mailbox"
    store = FsStore(mbx)
    build_mailbox(store)
    _commit(store, 43, {x: _publish(store, x, 43) for x in REGIONS}, "us", "all")
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert (
        "by us (all, waited 12.5 s for the last of eu, ap), 0.0 s after the round before; members: eu, us, ap\n"
        in out
    )


def test_status_tells_a_crashs_leave_from_a_planned_stops_by_the_records_why(tmp_path, sites):
    """us came back and crashed: the node program's leave announcer (the real one, from the trainer's
    arguments) wrote its leave; ap stopped through its stop file, and its trainer wrote its own. The presence
    column and the JSON say why each left."""
    mbx = tmp_path / "mailbox"
    store = FsStore(mbx)
    build_mailbox(store)
    _membership(store, "us").announce("joined", 40, 4000)
    xr = CrossRegion.model_validate(
        {**yaml.safe_load(XR), "region": "us", "transport": {"kind": "fs", "root": str(mbx)}}
    )
    rc, line = leave.announce(1, ["--config", "c.yaml", "--run-dir", str(tmp_path / "us"), *to_argv(xr)])
    assert rc == 0 and "announced the leave of region us" in line, line
    _membership(store, "ap").announce("leaving", 42, 4200, "stop file: SIGTERM to the training step on n7")
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    rows = _table(out)
    assert rows["us"][2] == "leaving (round 40): torchrun exited with status 1", out
    assert rows["ap"][2] == "leaving (round 42): stop file: SIGTERM to the training step on n7", out
    assert rows["eu"][2] == "joined (round 38)", out  # a record without a why: as before
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites), "--json")
    why = {r["region"]: r["presence_why"] for r in json.loads(out)["regions"]}
    assert why == {
        "eu": "",
        "us": "torchrun exited with status 1",
        "ap": "stop file: SIGTERM to the training step on n7",
    }


def test_empty_or_missing_mailbox_is_not_a_crash(tmp_path, sites):
    mbx = tmp_path / "not-there"
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert "no rounds committed yet" in out and "does not exist yet" in out
    assert not mbx.exists()  # a status query creates nothing
    mbx.mkdir()
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert "no rounds committed yet" in out and "does not exist" not in out
    assert _table(out)["us"][1:5] == ["-", "absent", "-", "-"]


def test_site_without_cross_region_is_bad_input(sites):
    write_site(sites, "solo", "enabled: false\n")
    code, out, err = sg("status", "--site", "solo", "--sites-dir", str(sites))
    assert code == 2
    assert "cross_region.enabled: site 'solo' is not part of a cross-region run" in err
    assert "Traceback" not in err


def test_unreadable_mailbox_is_one_line_exit_1(tmp_path, sites, monkeypatch):
    mbx = tmp_path / "mailbox"
    store = FsStore(mbx)
    build_mailbox(store)
    store.put(f"{RUN}/{round_tag(42)}/_commit.json", b"{not json")
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"sbatch-gen: mailbox fs:{mbx}: unreadable round commit"), err
    # S3 credentials named by an SSH profile (its launcher sends the shell's) but not set: one line naming
    # the bucket
    monkeypatch.delenv("XR_NOPE_KEY", raising=False)
    ssh = (REPO / "sites" / "ssh-local.yaml").read_text()
    (sites / "s3.yaml").write_text(
        ssh
        + "\ncross_region:\n"
        + "".join(f"  {line}\n" for line in XR.splitlines())
        + "  transport:\n    kind: s3\n    bucket: some-bucket\n    prefix: team/xr\n"
        "    credentials: {access_key_id_env: XR_NOPE_KEY, secret_access_key_env: XR_NOPE_SECRET}\n"
    )
    code, out, err = sg("status", "--site", "s3", "--sites-dir", str(sites))
    assert code == 1, err
    assert err.strip() == (
        "sbatch-gen: mailbox s3://some-bucket/team/xr: S3 credentials: environment variable "
        "XR_NOPE_KEY is not set (named by the site profile)"
    )


def test_status_from_an_s3_mailbox(s3server, bucket, sites, monkeypatch):
    store = S3Store(
        bucket,
        "team/xr",
        endpoint_url=s3server.endpoint_url,
        addressing_style="path",
        region_name="us-east-1",
        access_key_id_env=KEY_ENV,
        secret_access_key_env=SECRET_ENV,
    )
    try:
        build_mailbox(store)
    finally:
        store.close()
    write_site(
        sites,
        "eu",
        XR + f"transport:\n  kind: s3\n  bucket: {bucket}\n  prefix: team/xr\n"
        f"  endpoint_url: {s3server.endpoint_url}\n  addressing_style: path\n  region_name: us-east-1\n"
        f"  credentials: {{access_key_id_env: {KEY_ENV}, secret_access_key_env: {SECRET_ENV}}}\n",
    )
    # The keys are where the job reads them, slurm.secrets_file, and not in this shell: status reads the file
    import os

    keys = {KEY_ENV: os.environ[KEY_ENV], SECRET_ENV: os.environ[SECRET_ENV]}
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.delenv(SECRET_ENV)
    write_secrets(sites, keys)
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert f"mailbox:   s3://{bucket}/team/xr" in out
    assert "committed: round 42" in out and "snapshot:  round 40" in out
    rows = _table(out)
    assert rows["us"][1:5] == ["round 40", "leaving (round 40)", "2", "no"]


def _watch(sites, *flags):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "sbatch-gen"
    cmd = [
        str(exe),
        "status",
        "--site",
        "eu",
        "--sites-dir",
        str(sites),
        "--watch",
        "--interval",
        "0.2",
        *flags,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until(proc, pred, what: str, timeout: float = 60):
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if sel.select(timeout=1):
            line = proc.stdout.readline()
            assert line, f"status --watch ended before {what}: {proc.stderr.read()}"
            seen.append(line)
            if pred(line):
                return line
    raise AssertionError(f"no {what} within {timeout} s; last lines: {seen[-3:]}")


@pytest.mark.slow  # sbatch-gen in a subprocess, for Ctrl-C
def test_status_watch_follows_a_region_back_and_ends_on_ctrl_c(tmp_path, sites):
    """--watch --json: one object per read; us, away since round 40, comes back and takes part in round 43;
    the watch shows it on its next read; Ctrl-C ends it with exit 0, nothing on stderr."""
    import signal

    store = FsStore(tmp_path / "mailbox")
    build_mailbox(store)
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{tmp_path / 'mailbox'}'}}\n")
    proc = _watch(sites, "--json")
    try:
        first = json.loads(_read_until(proc, lambda line: line.startswith("{"), "a first read"))
        us = {r["region"]: r for r in first["regions"]}["us"]
        assert first["newest_commit"]["round"] == 42 and us["presence"] == "leaving" and us["behind"] == 2
        ms = _membership(store, "us")  # us is back: joins, and rounds 43 closes with everyone
        ms.announce("joined", 43, 4300)
        ms.mb.close()
        _commit(store, 43, {x: _publish(store, x, 43) for x in REGIONS}, "us", "all")

        def back(line):
            st = json.loads(line)
            regions = {r["region"]: r for r in st["regions"]}
            return st["newest_commit"]["round"] == 43 and regions["us"]["presence"] == "joined"

        st = json.loads(_read_until(proc, back, "us back in round 43"))
        us = {r["region"]: r for r in st["regions"]}["us"]
        assert us["behind"] == 0 and us["in_newest_commit"] is True
        assert st["newest_commit"]["interval_s"] is not None  # round 42's commit is still there
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # sbatch-gen in a subprocess, for Ctrl-C
def test_status_watch_shows_a_read_error_and_keeps_watching(tmp_path, sites):
    import signal

    mbx = tmp_path / "mailbox"
    build_mailbox(FsStore(mbx))
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{mbx}'}}\n")
    proc = _watch(sites)
    try:
        _read_until(proc, lambda line: line.startswith("committed: round 42"), "the table")
        commit = mbx / RUN / "r000042" / "_commit.json"
        commit.write_text("{not json")  # a damaged commit: the read fails, the watch goes on
        line = _read_until(proc, lambda line: "mailbox fs:" in line, "the read error")
        assert "trying again in 0.2 s" in line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0 and "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_watch_marks_a_joined_region_gone_once_its_heartbeat_stops(tmp_path, sites):
    """--watch: a joined region whose heartbeat stays unchanged for 3 intervals on the watcher's own clock,
    without a leave, is GONE (killed or crashed); one that beats again is not; a leaving one never is."""
    from sbatch_gen.cli import _format_status
    from sbatch_gen.loader import load_site
    from sbatch_gen.mailbox_status import HeartbeatWatch, read_status

    store = FsStore(tmp_path / "mailbox")
    build_mailbox(store)
    ms = _membership(store, "ap")
    ms.announce("joined", 42, 4200)
    store.put(ms.alive_key("ap"), Heartbeat("ap", "x2", 7, 5.0, time.time(), "job-ap").to_json())
    write_site(sites, "eu", XR + f"transport: {{kind: fs, root: '{tmp_path / 'mailbox'}'}}\n")
    xr = load_site(sites, "eu", []).profile.cross_region
    assert xr.heartbeat_s == 5.0
    clock = [100.0]
    watch = HeartbeatWatch(lambda: clock[0])

    def read() -> dict:
        return {r.region: r for r in watch.mark(read_status(xr)).regions}

    first = read()
    assert {r: (x.silent_s, x.gone) for r, x in first.items()} == {
        "eu": (0.0, False),
        "us": (0.0, False),
        "ap": (0.0, False),
    }
    clock[0] += 14.9  # eu beats meanwhile; us (leaving) and ap do not
    HeartbeatWriter(store, ms.alive_key("eu"), "eu", 5.0, "job-eu").beat()
    second = read()
    assert second["eu"].silent_s == 0.0 and not second["ap"].gone
    clock[0] += 0.2  # ap: 15.1 s unchanged, over 3 x 5 s
    st = watch.mark(read_status(xr))
    third = {r.region: r for r in st.regions}
    assert third["ap"].gone and not third["us"].gone and not third["eu"].gone
    assert abs(third["us"].silent_s - 15.1) < 1e-9
    rows = _table("\n".join(_format_status(st)))
    assert rows["ap"][2] == "GONE, was joined (round 42)", rows["ap"]
    assert rows["ap"][-1].endswith(", unchanged 15 s"), rows["ap"]
    assert rows["us"][2].startswith("leaving"), rows["us"]
    ms.mb.close()


def test_status_reads_the_secrets_file_as_the_job_does(s3server, bucket, sites, monkeypatch):
    """A Slurm site's S3 keys come from slurm.secrets_file, with the job's checks: a file others may read,
    a line that is not NAME=value, a key missing, or no file is one line (exit 2) naming the file and the
    profile field, never a value; the shell's values are not used in its stead."""
    import os

    path = write_site(
        sites,
        "eu",
        XR + f"transport:\n  kind: s3\n  bucket: {bucket}\n  prefix: team/xr\n"
        f"  endpoint_url: {s3server.endpoint_url}\n  addressing_style: path\n  region_name: us-east-1\n"
        f"  credentials: {{access_key_id_env: {KEY_ENV}, secret_access_key_env: {SECRET_ENV}}}\n",
    )
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "secrets_file:" in t)
    at = f"{path}:{line}: slurm.secrets_file: "
    keys = {KEY_ENV: os.environ[KEY_ENV], SECRET_ENV: os.environ[SECRET_ENV]}
    secrets = sites / "secrets.env"

    def fails() -> str:
        code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)
        assert not any(v in err for v in keys.values()), err
        return err.strip()

    # the shell holds the keys, but the job would not take them from there: no file is an error
    assert fails() == (
        f"sbatch-gen: {at}no secrets file {secrets}: write NAME=value lines for {KEY_ENV} "
        f"(cross_region.transport.credentials.access_key_id_env), {SECRET_ENV} "
        "(cross_region.transport.credentials.secret_access_key_env) into it, chmod 600 (status reads the S3 "
        "credentials from it, as the job does)"
    )
    write_secrets(sites, keys, mode=0o644)
    assert f"{at}secrets file {secrets} is mode 644: others may read it; chmod 600 {secrets}" in fails()
    secrets.write_text(f"{KEY_ENV}={keys[KEY_ENV]}\nnot a line\n")
    secrets.chmod(0o600)
    assert f"{at}secrets file {secrets}, line 2: not NAME=value" in fails()
    write_secrets(sites, {KEY_ENV: keys[KEY_ENV], SECRET_ENV: ""})
    assert f"{at}secrets file {secrets} has no value for {SECRET_ENV} (" in fails()
    # the file good, the shell's values wrong or gone: the file's are used
    write_secrets(sites, {KEY_ENV: f"'{keys[KEY_ENV]}'", SECRET_ENV: keys[SECRET_ENV]})
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(SECRET_ENV, "")
    code, out, err = sg("status", "--site", "eu", "--sites-dir", str(sites))
    assert code == 0, err
    assert f"mailbox:   s3://{bucket}/team/xr" in out
