"""The one reader of a JSONL file being appended to (sbatch_gen/jsonl.py): only lines their newline ended."""

from __future__ import annotations

from sbatch_gen.jsonl import complete_lines


def test_complete_lines_leave_a_line_being_written_for_the_next_read(tmp_path):
    p = tmp_path / "m.jsonl"
    assert complete_lines(p, 7) == ([], 7)  # no file yet
    p.write_bytes(b'{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    lines, end = complete_lines(p)
    assert lines == [b'{"step": 1}', b"", b'{"step": 2}'] and end == len(b'{"step": 1}\n\n{"step": 2}\n')
    assert complete_lines(p, end) == ([], end)  # the cut line waits
    assert complete_lines(p, 0, 13) == ([b'{"step": 1}', b""], 13)  # up to a byte
    with open(p, "ab") as f:
        f.write(b'ss": 3.0}\n')
    assert complete_lines(p, end) == ([b'{"step": 3, "loss": 3.0}'], p.stat().st_size)
