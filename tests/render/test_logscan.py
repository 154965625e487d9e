"""sbatch_gen/testing/logscan.py, which the soaks (`make soak`) read every log with."""

from __future__ import annotations

from sbatch_gen.testing.logscan import tracebacks


def test_tracebacks_are_found_in_files_and_trees_with_their_place(tmp_path):
    (tmp_path / "logs" / "a").mkdir(parents=True)
    (tmp_path / "logs" / "a" / "job-1.attempt-0.n1.log").write_text(
        "step 1\n[rank 1/2] Traceback (most recent call last):\n  File x\nValueError: y\n"
    )
    (tmp_path / "logs" / "clean.out").write_text("training finished\n")
    (tmp_path / "logs" / "model.safetensors").write_bytes(b"Traceback")  # not a log: not read
    (tmp_path / "launcher.out").write_text("Traceback (most recent call last):\n")
    found = tracebacks(tmp_path / "launcher.out", tmp_path / "logs", tmp_path / "missing")
    assert [f.split("\n", 1)[0] for f in found] == [
        f"{tmp_path / 'launcher.out'}:1:",
        f"{tmp_path / 'logs' / 'a' / 'job-1.attempt-0.n1.log'}:2:",
    ]
    assert "ValueError: y" in found[1] and "step 1" in found[1]
    assert tracebacks(tmp_path / "logs" / "clean.out") == []
