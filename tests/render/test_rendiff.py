"""A change that many renders share is shown once (issue 28, item 2): sbatch_gen/rendiff.py, and through
`sbatch-gen check` and `sbatch-gen diff --all` on real renders."""

from __future__ import annotations

import shutil
import subprocess

from sbatch_gen.rendiff import FileChange, file_diff, grouped_diff

from .conftest import REPO, sg


def _render(site: str, value: str, library: str = "lib-line") -> str:
    """A render-like file: a site setting near the top, a long shared part, the library near the end."""
    body = [f"# site {site}", f"VALUE={value}"] + [f"shared {i}" for i in range(20)] + [library, "end"]
    return "\n".join(body) + "\n"


SITES = ["eu", "us", "local", "lab"]


def test_a_template_change_in_every_file_is_shown_once_naming_every_file():
    changes = [FileChange(f"out/{s}", _render(s, s), _render(s, s, "lib-line changed")) for s in SITES]
    out = grouped_diff(changes)
    assert out.count("-lib-line\n") == 1 and out.count("+lib-line changed\n") == 1
    assert out.startswith("# shared change 1 of 1: the same lines in 4 files\n")
    for s in SITES:
        assert f"#   out/{s} (line " in out
        assert f"# out/{s}: also shared change 1 (above)\n" in out
    assert "--- a/out/eu" in out  # the shared hunk is shown as the first file has it
    assert "+++ b/out/us\n" not in out  # no file has a hunk of its own


def test_a_one_field_change_in_one_site_shows_only_that_sites_lines_as_a_plain_diff():
    changes = [FileChange("out/eu", _render("eu", "1"), _render("eu", "2"))]
    out = grouped_diff(changes)
    assert out == file_diff(changes[0])  # nothing shared: exactly the unified diff
    assert out.startswith("--- a/out/eu\n+++ b/out/eu\n@@ ")
    assert [x for x in out.splitlines() if x[:1] in "-+" and not x.startswith(("---", "+++"))] == [
        "-VALUE=1",
        "+VALUE=2",
    ]
    assert "shared" not in out.split("@@", 2)[2].replace("shared ", "")  # no grouping notes


def test_mixed_a_shared_change_once_and_each_files_own_change():
    changes = [
        FileChange("out/eu", _render("eu", "1"), _render("eu", "2", "lib-line changed")),
        FileChange("out/us", _render("us", "1"), _render("us", "1", "lib-line changed")),
        FileChange("out/local", _render("local", "1"), _render("local", "1", "lib-line changed")),
        FileChange("out/new", None, "#!/bin/bash\n"),
    ]
    out = grouped_diff(changes)
    assert out.count("+lib-line changed\n") == 1
    assert "the same lines in 3 files" in out
    shared, own = out.split("# out/eu: also shared change 1 (above)\n", 1)
    assert "-VALUE=1\n+VALUE=2\n" in own and "VALUE" not in shared.replace("VALUE=1\n", "")
    assert own.startswith("--- a/out/eu\n+++ b/out/eu\n@@ -1,")
    assert "# out/us: also shared change 1 (above)\n# out/local:" in out  # nothing of their own
    assert "# out/new: its own changes\n--- /dev/null\n+++ b/out/new\n" in out  # a new file: never grouped


def test_no_difference_no_output():
    same = _render("eu", "1")
    assert grouped_diff([FileChange("out/eu", same, same)]) == ""
    assert grouped_diff([]) == ""


def test_check_shows_a_template_change_once_and_diff_all_too(work):
    """A one-line change in the node functions (templates/_node.j2) is one hunk in check's output for each
    group of files that carry it alike: the Slurm scripts' bootstraps, the setup scripts' fenced libraries (with
    their sha256 line, a few lines up), the SSH library; one in the job library (templates/slurm-job.sh.j2) is
    one hunk of
    out/sbatch-gen-job.sh, and the Slurm training scripts' pinned sha256 one line; a one-field profile change
    is then that site's own lines."""
    shutil.copytree(REPO / "out", work / "out")
    shutil.copytree(REPO / "templates", work / "templates")
    node = work / "templates" / "_node.j2"
    old = '# die CODE MESSAGE...: log "ERROR: MESSAGE" and exit with CODE.'
    node.write_text(node.read_text().replace(old, old + " (reviewed once)"))
    lib = work / "templates" / "slurm-job.sh.j2"
    tails = "# node_tails LOG...: the last 20 lines of each node's log of a failed step, into this log."
    assert tails in lib.read_text()
    lib.write_text(lib.read_text().replace(tails, tails + " (reviewed once)"))
    site = work / "sites" / "us.yaml"
    site.write_text(site.read_text().replace("cpus_per_task: 72", "cpus_per_task: 64"))
    r = sg("check", "--templates-dir", "templates")
    assert r.code == 1, r.err
    trainers = ["out/eu.sbatch", "out/lab.sh", "out/local.sbatch", "out/ssh-local.sh", "out/us.sbatch"]
    setups = ["out/eu.setup.sbatch", "out/local.setup.sbatch", "out/us.setup.sbatch"]
    assert r.out.count("+" + old + " (reviewed once)\n") == 3
    carriers = ["out/eu.sbatch", "out/local.sbatch", "out/us.sbatch"]
    hunks = [h for h in r.out.split("# shared change ")[1:] if "+" + old + " (reviewed once)\n" in h]
    for group in (carriers, setups):  # one hunk each, naming the place in each file
        shared = [h.split("\n---", 1)[0] for h in hunks if f"#   {group[0]} (line " in h]
        assert len(shared) == 1 and all(f"#   {name} (line " in shared[0] for name in group), hunks
    assert "# out/sbatch-gen-ssh.sh: its own changes\n" in r.out
    # and the SSH launchers' pin of the SSH library: one hunk
    assert r.out.count("the same lines in 3 files") == 2 and "the same lines in 2 files" in r.out
    assert r.out.count("\n+SSH_LIB_SHA256=") == 1
    # the job library: its own hunk, once; the training scripts name its new sha256
    assert r.out.count("+" + tails + " (reviewed once)\n") == 1
    assert "# out/sbatch-gen-job.sh: its own changes\n" in r.out
    assert r.out.count("\n+JOB_LIB_SHA256=") == 2  # eu and local's shared line, and us's own hunk
    assert "-#SBATCH --cpus-per-task=72\n+#SBATCH --cpus-per-task=64\n" in r.out
    # us's own change: the lines that depend on slurm.cpus_per_task, in its own part only
    own = r.out[r.out.index("--- a/out/us.sbatch\n") :]
    assert r.out.count("--cpus-per-task=64") == own.count("--cpus-per-task=64") == 1
    assert r.out.count("+CPUS_PER_TASK=64  # slurm.cpus_per_task") == own.count("+CPUS_PER_TASK=64") == 1
    # every file's new inputs sha256: one line, not a hunk per file
    assert (
        "\n# the header's inputs sha256 changed in: " + ", ".join(sorted(trainers + setups)) + "\n" in r.out
    )
    assert "+#   inputs sha256: " not in r.out
    assert "differ from a fresh render" in r.err
    d = sg("diff", "--all", "--templates-dir", "templates")
    assert d.code == 1 and d.out == r.out


def test_diff_against_a_git_revision_compares_committed_renders(tmp_path):
    repo = tmp_path / "repo"
    (repo / "out").mkdir(parents=True)
    for s in SITES:
        (repo / "out" / f"{s}.sbatch").write_text(_render(s, s))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "renders"], check=True)
    for s in SITES:
        (repo / "out" / f"{s}.sbatch").write_text(_render(s, s, "lib-line changed"))
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "sbatch-gen"), "diff", "--against", "HEAD", "out"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stderr
    assert r.stdout.startswith("# shared change 1 of 1: the same lines in 4 files\n"), r.stdout
    assert r.stdout.count("+lib-line changed\n") == 1
    subprocess.run([*git, "commit", "-qam", "new"], check=True)
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "sbatch-gen"), "diff", "--against", "HEAD"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "no changes against HEAD" in r.stdout, r.stdout + r.stderr
