"""Every committed render reads top-down (issue 28, item 1): the #SBATCH header (or the SSH launcher's
usage), the settings, then main() with the job's flow in order, the launch and the requeue (relaunch)
decision within its first lines; after main its helpers, then the node library between its fences, with
its own sha256; `main "$@"` is the last line."""

from __future__ import annotations

import pytest

from .conftest import REPO
from .script_parts import LIBRARY_END, LIBRARY_START, library_lines, library_sha_ok

RENDERS = sorted(
    p
    for d in (REPO / "out", REPO / "examples" / "out")
    for p in d.iterdir()
    if p.suffix in (".sbatch", ".sh")
)
TRAINING = [p for p in RENDERS if not p.name.endswith(".setup.sbatch")]

# The job's decisions come early. The training launch (main's first srun: the preflight's is a helper's)
# follows torchrun's and the trainer's argument lists, 40 lines of --xr-* flags for the cross-region sites,
# which puts it at line 263 for eu, and the requeue decision a few lines later.
LAUNCH_BY = 265
DECISION_BY = 275
# ...and where the flow ends: main's closing brace, after the requeue decision and all it does (325 in eu;
# the SSH launcher's main is its attempts loop, 163 in lab.sh). What follows is helpers and the library.
MAIN_END_BY = 330


def _ids(paths):
    return [p.relative_to(REPO).as_posix() for p in paths]


def _line(lines: list[str], pred) -> int:
    """1-based number of the first line for which pred holds (0: none)."""
    return next((i for i, x in enumerate(lines, 1) if pred(x)), 0)


@pytest.mark.parametrize("path", RENDERS, ids=_ids(RENDERS))
def test_main_comes_first_then_the_node_library_then_the_call(path):
    lines = path.read_text().splitlines()
    main = lines.index("main() {") + 1
    main_end = lines.index("}", main) + 1
    library = _line(lines, lambda x: x.startswith(LIBRARY_START))
    library_end = _line(lines, lambda x: x.startswith(LIBRARY_END))
    assert main < main_end < library < library_end, (main, main_end, library, library_end)
    assert lines[-1] == 'main "$@"'
    # nothing runs before main but assignments: no function is defined before main
    assert not [x for x in lines[: main - 1] if x.endswith("() {")]
    assert library_sha_ok(path.read_text())


@pytest.mark.parametrize("path", TRAINING, ids=_ids(TRAINING))
def test_the_launch_and_the_requeue_decision_come_early(path):
    lines = path.read_text().splitlines()
    main = lines.index("main() {") + 1
    main_end = lines.index("}", main) + 1
    if path.suffix == ".sbatch":
        launch = _line(lines, lambda x: x.startswith("  srun "))
        decision = _line(
            lines, lambda x: x.startswith("  # ---- how the attempt ended decides what comes next")
        )
    else:
        launch = _line(lines, lambda x: x.strip() == 'launch_all "$resume"')
        decision = _line(lines, lambda x: x.strip().startswith("# The relaunch decision: "))
    assert main < launch <= LAUNCH_BY, (main, launch)
    assert launch < decision <= DECISION_BY and decision < main_end <= MAIN_END_BY, (decision, main_end)


def test_the_slurm_and_ssh_renders_share_one_node_library():
    """The library is written once (templates/_node.j2): a Slurm and an SSH render that use the same
    functions carry it byte for byte, so a change to it is one hunk, the same in every file."""
    eu = library_lines((REPO / "out" / "eu.sbatch").read_text())
    lab = library_lines((REPO / "out" / "lab.sh").read_text())
    assert eu == lab
    assert "\npreflight() {\n" in eu[1] and "\nnode_py() {\n" in eu[1] and "\nnode_lines() {\n" in eu[1]
    assert "SITE=" not in eu[1] and "eu" not in eu[1].split()  # no site setting in it
