"""Every committed render reads top-down (issues 28 and 41): the #SBATCH header (or the SSH launcher's
usage), the settings, then main() with the job's flow in order, the launch and the requeue (relaunch)
decision within its first lines, and where the flow ends. After main: in a Slurm training script only its
bootstrap (log/die and how main finds its pinned files: the job library it sources and the node program);
in an SSH launcher the two functions that hold its site's settings and how main finds the SSH library it
sources; in the setup scripts the helpers, then the node library between its fences, with its own sha256.
`main "$@"` is the last line. The libraries (out/sbatch-gen-job.sh, out/sbatch-gen-ssh.sh) define functions
only."""

from __future__ import annotations

import re

import pytest

from sbatch_gen.render import JOB_LIBRARY_FILE, LIBRARIES, SSH_LIBRARY_FILE

from .conftest import REPO
from .script_parts import LIBRARY_END, LIBRARY_START, function_text, library_lines, library_sha_ok

OUT_DIRS = (REPO / "out", REPO / "examples" / "out")
RENDERS = sorted(
    p for d in OUT_DIRS for p in d.iterdir() if p.suffix in (".sbatch", ".sh") and p.name not in LIBRARIES
)
TRAINING = [p for p in RENDERS if not p.name.endswith(".setup.sbatch")]
SLURM_TRAINING = [p for p in TRAINING if p.suffix == ".sbatch"]
SSH_LAUNCHERS = [p for p in TRAINING if p.suffix == ".sh"]
LIBRARY_FILES = [d / name for d in OUT_DIRS for name in LIBRARIES if (d / name).exists()]

# The job's decisions come early. The training launch (main's first srun: the preflight's is the job
# library's) follows torchrun's and the trainer's argument lists (the trainer's --xr-* flags several to a
# line, each family after a comment naming its section), which puts it at line 169 for eu, and the requeue
# decision a few lines later.
LAUNCH_BY = 175
DECISION_BY = 185
# ...and where the flow ends: main's closing brace, after the requeue decision (183 in eu: the job library's
# end_attempt does it; the SSH launcher's main is its attempts loop, 179 in lab.sh).
MAIN_END_BY = 190
# A Slurm training script whole: 218 lines for eu (250 before the job library pinned the node program, its git
# blob id replaced the bootstrap's walk of git history, options without a profile key went three to a line and
# comments were condensed, and the preflight took the torchrun flags it checks from TORCHRUN_ARGS; 267 before the summary of main's steps became the comment
# on the decision, the preflight's export -f preflight_nodes' own and EXIT_REQUEUE the job library's; 281 before the preflight's settings that every site has
# became the job library's preflight_nodes and the rendezvous host its rendezvous; 319 before the decision
# after the training step became the job library's end_attempt; 801 before its helpers and node functions
# became the job library and the trainer's --xr-*/--metrics-* flags went three to a line; 373 before this
# attempt's bookkeeping became the library's start_attempt and one stage_pinned replaced find_pinned's two
# passes), the bootstrap after main included.
SLURM_SCRIPT_LINES = 218
# The bootstrap after a Slurm training script's main: these functions, nothing else.
BOOTSTRAP = ["log", "die", "stage_pinned"]
# After an SSH launcher's main: the function that holds its site's settings (torchrun's and the trainer's
# flags), then its bootstrap.
SSH_AFTER_MAIN = ["node_main", "pinned_library"]
# An SSH launcher whole: 240 lines for lab.sh (242 before the bucket check's comment went with the check; 261 before debug_env became a node function both launchers share
# and options without a profile key went three to a line, and TORCHRUN_FLAGS became the flags' names; 285 before its preflight_main became the SSH library's; 734
# before its functions but node_main and preflight_main became the SSH library).
SSH_LAUNCHER_LINES = 240


def _ids(paths):
    return [p.relative_to(REPO).as_posix() for p in paths]


def _line(lines: list[str], pred) -> int:
    """1-based number of the first line for which pred holds (0: none)."""
    return next((i for i, x in enumerate(lines, 1) if pred(x)), 0)


def _functions(lines: list[str]) -> list[str]:
    return [m.group(1) for x in lines if (m := re.match(r"^([a-z_]+)\(\) \{", x))]


@pytest.mark.parametrize("path", RENDERS, ids=_ids(RENDERS))
def test_main_comes_first_then_its_helpers_then_the_call(path):
    lines = path.read_text().splitlines()
    main = lines.index("main() {") + 1
    main_end = lines.index("}", main) + 1
    assert lines[-1] == 'main "$@"'
    # nothing runs before main but assignments: no function is defined before main
    assert not [x for x in lines[: main - 1] if x.endswith("() {")]
    if path in SLURM_TRAINING or path in SSH_LAUNCHERS:
        assert _functions(lines[main_end:]) == (BOOTSTRAP if path in SLURM_TRAINING else SSH_AFTER_MAIN)
        assert LIBRARY_START not in path.read_text()
        return
    library = _line(lines, lambda x: x.startswith(LIBRARY_START))
    library_end = _line(lines, lambda x: x.startswith(LIBRARY_END))
    assert main < main_end < library < library_end, (main, main_end, library, library_end)
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


@pytest.mark.parametrize("path", SLURM_TRAINING, ids=_ids(SLURM_TRAINING))
def test_a_slurm_training_script_is_read_whole(path):
    """Its flow, its settings and the bootstrap: the helpers are the job library's, pinned by sha256."""
    text = path.read_text()
    assert len(text.splitlines()) <= SLURM_SCRIPT_LINES
    assert re.search(r"^JOB_LIB_SHA256=[0-9a-f]{64}  # ", text, re.M)
    assert '  source "$JOB_LIB"\n' in text


@pytest.mark.parametrize("path", SSH_LAUNCHERS, ids=_ids(SSH_LAUNCHERS))
def test_an_ssh_launcher_is_read_whole(path):
    """Its settings, its flow and the two functions with its site's settings: the rest is the SSH library's,
    pinned by sha256."""
    text = path.read_text()
    assert len(text.splitlines()) <= SSH_LAUNCHER_LINES
    assert re.search(r"^SSH_LIB_SHA256=[0-9a-f]{64}  # ", text, re.M)
    assert '  source "$SSH_LIB"\n' in text


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=_ids(LIBRARY_FILES))
def test_a_library_defines_functions_and_reads_no_site_setting(path):
    """Sourced by every Slurm training script (the job library) or SSH launcher (the SSH library): function
    definitions only (nothing runs when it is sourced), the same bytes in every render directory, and the
    sha256 every script there that sources it pins."""
    text = path.read_text()
    assert text == (REPO / "out" / path.name).read_text()
    depth = 0
    for x in text.splitlines():  # at the top level: comments, blank lines, function definitions
        if depth == 0:
            assert x == "" or x.startswith("#") or re.match(r"^[a-z_0-9]+\(\) \{", x), x
        depth += x.count("{") - x.count("}") if not x.lstrip().startswith("#") else 0
    import hashlib

    sha = hashlib.sha256(text.encode()).hexdigest()
    users = [
        p
        for p in (SLURM_TRAINING if path.name == JOB_LIBRARY_FILE else SSH_LAUNCHERS)
        if p.parent == path.parent
    ]
    assert users
    for script in users:
        assert f"{LIBRARIES[path.name][2]}={sha}  #" in script.read_text(), script
    for word in (
        "eu",
        "us",
        "h200",
        "llm-xr",
        "ib0",
        "lab-gpu01",
        "ssh-local",
    ):  # no site, partition, run or interface
        assert word not in text.split(), word


def test_the_slurm_and_ssh_renders_share_one_node_library():
    """The node functions are written once (templates/_node.j2): the Slurm job library carries the SSH
    library's byte for byte, so a change to them is one hunk, the same in every file."""
    lab = library_lines((REPO / "out" / SSH_LIBRARY_FILE).read_text())[1]
    lib = (REPO / "out" / JOB_LIBRARY_FILE).read_text()
    eu = (REPO / "out" / "eu.sbatch").read_text()
    for name in ("activate_env", "load_modules", "node_py", "preflight", "node_lines"):
        assert function_text(lab, name) and function_text(lab, name) == function_text(lib, name), name
    for name in ("log", "die"):  # the bootstrap's own (stage_pinned is a Slurm job's: SSH ships the program)
        assert function_text(lab, name) and function_text(lab, name) == function_text(eu, name), name
