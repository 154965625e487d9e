"""The parts of a rendered script, for tests that run or compare one part of it.

A render reads top-down: the settings, then ``main() { ... }`` with the job's flow, then (a setup script)
its helpers and the node library between its fences, or (a training script) its bootstrap, then
``main "$@"`` (templates/slurm.sbatch.j2, ssh-launcher.sh.j2). A Slurm training script's helpers and node
functions are the job library it sources (templates/slurm-job.sh.j2, out/sbatch-gen-job.sh), an SSH
launcher's the SSH library (templates/ssh-lib.sh.j2, out/sbatch-gen-ssh.sh;
sbatch_gen.testing.ssh_launcher.ssh_launcher_functions sources it as the launcher does)."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

from sbatch_gen.render import job_library

LIBRARY_START = "# ==== node library ="
LIBRARY_SHA = "# library sha256: "
LIBRARY_END = "# ==== end of node library ="
# The node program the library's preflight runs (the source; render writes it as out/sbatch-gen-node.py).
NODE_PROGRAM = Path(__file__).resolve().parents[2] / "sbatch_gen" / "node_program.py"
# The files of a render directory that are scripts (the node program beside them is Python).
SCRIPT_SUFFIXES = (".sbatch", ".sh")


def flat(text: str) -> str:
    """The render with main()'s body dedented in place, so a block of the job's flow (TRAINER_ARGS=(...),
    an srun line) can be cut out and run at the top level, as it could before the flow became main()."""
    lines = text.splitlines(keepends=True)
    start = lines.index("main() {\n")
    end = lines.index("}\n", start)
    body = [line[2:] if line.startswith("  ") else line for line in lines[start + 1 : end]]
    return "".join(lines[: start + 1] + body + lines[end:])


def library_lines(text: str) -> tuple[str, str]:
    """(the sha256 the library's fence names, the library: the lines between that line and the end fence)."""
    i = text.index("\n" + LIBRARY_SHA) + 1
    j = text.index("\n", i) + 1
    k = text.index("\n" + LIBRARY_END, j) + 1
    return text[i + len(LIBRARY_SHA) : j - 1], text[j:k]


def bootstrap(text: str) -> str:
    """A Slurm training script's own functions after main (log/die, find_pinned, stage_pinned)."""
    i = text.index("\n}\n", text.index("\nmain() {\n")) + 3
    return text[i : text.rindex('\nmain "$@"')] + "\n"


def node_library(text: str) -> str:
    """The node library: log/die, the python_env activation, the node program's functions (node_py,
    preflight) and node_lines the render uses (what srun's and the SSH node program's bash run on the
    nodes), with the node program exported as the Slurm job exports it once staged (SBATCH_GEN_NODE_PY).
    A Slurm training script has them from its bootstrap and the job library it sources (render's
    job_library(): the file it writes beside the renders)."""
    if LIBRARY_SHA in text:
        functions = library_lines(text)[1]
    else:
        functions = bootstrap(text) + job_library().text
    return functions + f"export SBATCH_GEN_NODE_PY={shlex.quote(str(NODE_PROGRAM))}\n"


def library_sha_ok(text: str) -> bool:
    named, body = library_lines(text)
    return hashlib.sha256(body.encode()).hexdigest() == named


def function_text(text: str, name: str) -> str | None:
    """The definition of a shell function in a rendered script (None: not there)."""
    i = text.find(f"\n{name}() {{")
    if i < 0:
        return None
    end = text.index("\n", i + 1) if text[text.index("\n", i + 1) - 1] == "}" else text.index("\n}\n", i) + 2
    return text[i + 1 : end]
