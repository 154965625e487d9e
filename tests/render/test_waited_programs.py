"""The batch shell hears a signal while a slow program runs before the preflight.

Bash runs a trap only once a foreground program has returned, and a user's scancel signals the batch shell
alone (measured on the local cluster: a foreground child got no TERM, and Slurm's SIGKILL came after
KillWait with neither trap run). So the slow programs before the preflight run in the background and are
waited for (run_waited): Lmod's `module load` (its output applied to the batch shell, as Lmod's own `module`
function does), the copy of the checkout (paths.pin_code) and the environment's fingerprint. The rendered
`out/local.sbatch` runs for real under bash with stub Slurm commands (batch_sandbox.py) and the real Lmod
(Debian's `lmod`, make system-deps), whose modulefile here is slow until the test lets it go."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from .batch_sandbox import prepare, render_local, start_job

pytestmark = pytest.mark.slow  # runs the job for seconds, with Lmod (make system-deps)

SINFO = "#!/bin/bash\necho 'slurm 22.05.8'\n"
# show job: a job that Slurm is not ending (a TERM to the batch shell is then a user's scancel)
SCONTROL = r"""#!/bin/bash
[[ $1 != -o ]] || shift
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show job") echo "JobId=$3 JobName=x Requeue=1 Restarts=0 BatchFlag=1 Reason=None" ;;
  requeue*) echo "requeue $2" >>"$STUB_DIR/calls" ;;
esac
"""
# srun: every call noted; the training step also writes its environment
SRUN = r"""#!/bin/bash
echo "srun $*" >>"$STUB_DIR/calls"
for a in "$@"; do [[ $a == preflight ]] && exit 0; done
env >"$STUB_DIR/step.env"
"""
CANCELLED = "SIGTERM to the batch shell: the job was cancelled (scancel); not requeueing"


def _slow_module(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A modulefile `slow/1.0` for Lmod that sets SLOW_MODULE and holds until ``hold`` is gone, after
    touching ``inside``: (the MODULEPATH, inside, hold)."""
    mods = tmp_path / "modules"
    (mods / "slow").mkdir(parents=True)
    inside, hold = tmp_path / "in-module-load", tmp_path / "hold"
    (mods / "slow" / "1.0.lua").write_text(
        'setenv("SLOW_MODULE", "loaded")\n'
        f'os.execute("touch {inside}; while [ -e {hold} ]; do sleep 0.05; done")\n'
    )
    return mods, inside, hold


def _modules_job(tmp_path: Path, module: str, modulepath: Path):
    """The local site's job with python_env.modules [module], Lmod finding it in ``modulepath``, and the
    stub Slurm commands: (the job script, its environment, the stubs' note directory)."""
    return prepare(
        tmp_path,
        {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO},
        "-",
        script=render_local(f"python_env.modules=[{module}]"),
        env={"MODULEPATH": str(modulepath)},
    )


def _wait_for(path: Path, proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)


def _cancel_while_held(job: Path, env: dict[str, str], inside: Path, hold: Path) -> str:
    """Run the job; once ``inside`` exists, a TERM to the batch shell alone (as a scancel sends it). The
    cancellation's line must come within 10 s while ``hold`` still holds the slow program, and the job ends
    there (status 143), its last line that one: nothing runs on after the cancel. Its whole output."""
    proc = start_job(job, env)
    _wait_for(inside, proc)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    try:
        while not any(CANCELLED in line for line in lines):
            assert time.monotonic() < deadline, "no line within 10 s of the TERM:\n" + "".join(lines)
            time.sleep(0.05)
        assert proc.wait(timeout=10) == 143, "".join(lines)  # ended while the slow program still held
    finally:
        hold.unlink(missing_ok=True)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    said = [line for line in lines if line.startswith("[sbatch-gen ")]
    assert CANCELLED in said[-1], "".join(lines)
    return "".join(lines)


def test_lmod_is_real_here():
    """The tests below use Debian's Lmod, which make system-deps installs (never skipped)."""
    assert Path("/etc/profile.d/lmod.sh").is_file(), "no Lmod: run make system-deps"


def test_lmods_module_load_is_applied_to_the_job(tmp_path):
    """Lmod's program, run in the background: what it loads is in the job steps' environment."""
    mods, _, hold = _slow_module(tmp_path)
    job, env, stub_dir = _modules_job(tmp_path, "slow", mods)
    proc = start_job(job, env)
    out, _ = proc.communicate(timeout=60)
    assert not hold.exists()
    assert proc.returncode == 0 and "training finished" in out, out
    step_env = (stub_dir / "step.env").read_text().splitlines()
    assert "SLOW_MODULE=loaded" in step_env and "LOADEDMODULES=slow/1.0" in step_env, step_env


def test_a_module_lmod_does_not_know_fails_in_one_line(tmp_path):
    job, env, stub_dir = _modules_job(tmp_path, "no-such-module", tmp_path)
    proc = start_job(job, env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "ERROR: module load no-such-module failed (python_env.modules)" in out, out
    assert not (stub_dir / "calls").exists(), out


def test_a_scancel_during_a_slow_module_load_is_said_at_once(tmp_path):
    """A TERM to the batch shell alone while Lmod's program holds: the job says it was cancelled while the
    module load still runs, then starts no step."""
    mods, inside, hold = _slow_module(tmp_path)
    hold.touch()
    job, env, stub_dir = _modules_job(tmp_path, "slow", mods)
    out = _cancel_while_held(job, env, inside, hold)
    assert out.count(CANCELLED) == 1 and "Traceback" not in out, out
    assert not (stub_dir / "calls").exists(), out  # no preflight, no training step


def test_a_scancel_during_the_copy_of_the_checkout_is_said_at_once(tmp_path):
    """paths.pin_code's copy (here a git that holds) runs in the background: the TERM is said at once."""
    git = shutil.which("git")
    inside, hold = tmp_path / "in-git", tmp_path / "hold"
    hold.touch()
    slow_git = (
        f'#!/bin/bash\nif [[ " $* " == *" ls-files "* ]]; then touch {inside}; '
        f'while [ -e {hold} ]; do sleep 0.05; done; fi\nexec {git} "$@"\n'
    )
    job, env, stub_dir = prepare(
        tmp_path, {"scontrol": SCONTROL, "srun": SRUN, "sinfo": SINFO, "git": slow_git}, "-"
    )
    out = _cancel_while_held(job, env, inside, hold)
    assert out.count(CANCELLED) == 1 and "Traceback" not in out, out
    assert not (stub_dir / "calls").exists(), out
