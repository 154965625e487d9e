"""Which templates a render uses: those of the sbatch-gen that runs (the checkout it was installed from, or
the copy in its wheel), since the code that fills them in and they go together; never the working
directory's unasked. A working directory with other templates gets a note saying so; --templates-dir picks
them."""

from __future__ import annotations

import shutil

from .conftest import REPO, sg

MARK = "# a local edit of the templates"


def _edited_templates(work):
    shutil.copytree(REPO / "templates", work / "templates")
    job = work / "templates" / "slurm.sbatch.j2"
    job.write_text(job.read_text().replace("#!/bin/bash\n", f"#!/bin/bash\n{MARK}\n", 1))
    assert MARK in job.read_text()


def test_a_working_directory_with_other_templates_gets_a_note_and_the_running_ones(work):
    _edited_templates(work)
    for args in (
        ("render", "--site", "local", "--out", "o"),
        ("check", "--out", "o"),
        ("diff", "--site", "local", "--out", "o"),
    ):
        r = sg(*args)
        notes = [line for line in r.err.splitlines() if line.startswith("note: rendering with the templates")]
        assert len(notes) == 1, (args, r.err)
        assert f"{REPO / 'templates'}" in notes[0] and "not with ./templates, which differ" in notes[0]
        assert "--templates-dir templates" in notes[0]
    assert MARK not in (work / "o" / "local.sbatch").read_text()


def test_templates_dir_picks_the_working_directorys_templates_without_a_note(work):
    _edited_templates(work)
    r = sg("render", "--site", "local", "--out", "o", "--templates-dir", "templates")
    assert r.code == 0 and "note" not in r.err, r.err
    assert MARK in (work / "o" / "local.sbatch").read_text()


def test_the_same_templates_in_the_working_directory_get_no_note(work):
    shutil.copytree(REPO / "templates", work / "templates")
    r = sg("render", "--site", "local", "--out", "o")
    assert r.code == 0 and r.err == "", r.err


def test_a_templates_directory_of_something_else_gets_no_note(work):
    (work / "templates").mkdir()
    (work / "templates" / "index.html.j2").write_text("<html></html>\n")
    r = sg("render", "--site", "local", "--out", "o")
    assert r.code == 0 and r.err == "", r.err
