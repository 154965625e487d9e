"""``sbatch-gen doctor`` for a ``kind: ssh`` site: every host against the profile. Torch-free (torch is
imported by the hosts' python, never here).

Run it where the launcher runs: on the first host, from the launch directory. Node 0 is checked here, the
other hosts over ssh with the launcher's own options (``ssh.argv_lines()``: BatchMode=yes, ConnectTimeout,
port, user, identity, ``ssh.options``). One small probe per host reports, in ``SBG_KEY=value`` lines: the
launch directory, python_env's python importing torch, the GPU count, and whether ``paths.run_dir`` is
writable (or can be created). It writes nothing but a temporary file in an existing run dir, removed at once.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sbatch_gen.doctor.common import Check, CommandMissing, Result, Runner, error, ok, skip, warn
from sbatch_gen.errors import UserError
from sbatch_gen.loader import LoadedSite
from sbatch_gen.profiles.ssh import SshProfile

q = shlex.quote


def probe_script(p: SshProfile, launch_dir: str) -> str:
    """The bash program run on every host; it always exits 0 and says what it found in SBG_ lines."""
    env = p.python_env
    lines = [
        f"cd -- {q(launch_dir)} 2>/dev/null || {{ echo SBG_DIR=missing; exit 0; }}",
        "echo SBG_DIR=ok",
        "PY=",
    ]
    if env.modules:
        mods = " ".join(q(m) for m in env.modules)
        lines += [
            "if ! type module >/dev/null 2>&1; then for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do "
            '[[ -r $f ]] && { source "$f"; break; }; done; fi',
            f"module load {mods} >/dev/null 2>&1 || echo "
            + q(f"SBG_ENV=module load {' '.join(env.modules)} failed (python_env.modules)"),
        ]
    if env.kind == "venv":
        lines += [
            f"if [[ -x {q(env.path)}/bin/python ]]; then PY={q(env.path)}/bin/python; "
            f"else echo {q(f'SBG_ENV=no {env.path}/bin/python (python_env.path)')}; fi"
        ]
    elif env.kind == "conda":
        name = env.name if env.name is not None else env.prefix
        lines += [
            f"if source {q(env.conda_sh)} >/dev/null 2>&1 && conda activate {q(str(name))} >/dev/null 2>&1; "
            "then PY=$(command -v python); "
            f"else echo {q(f'SBG_ENV=conda activate {name} failed (python_env)')}; fi"
        ]
    else:
        lines += ["PY=$(command -v python || command -v python3) || echo 'SBG_ENV=no python on PATH'"]
    lines += [
        "if [[ -n $PY ]]; then",
        "  if out=$(\"$PY\" -c 'import torch; print(torch.__version__, torch.cuda.device_count())' 2>&1); then",
        '    echo "SBG_TORCH=$out"',
        '  else echo "SBG_TORCH_ERR=$(printf %s "$out" | tail -n 1)"; fi',
        '  echo "SBG_PY=$PY"',
        "fi",
        "if command -v nvidia-smi >/dev/null 2>&1; then",
        "  echo \"SBG_SMI=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')\"",
        "fi",
        f"d={q(p.paths.run_dir)}",
        "if [[ -d $d ]]; then",
        '  if f=$(mktemp "$d/.sbatch-gen-doctor.XXXXXX" 2>/dev/null); then rm -f -- "$f"; echo SBG_RUN=writable;',
        "  else echo SBG_RUN=not-writable; fi",
        "elif [[ -e $d ]]; then echo SBG_RUN=not-a-directory",
        "else",
        '  a=$(dirname -- "$d"); while [[ ! -e $a ]]; do a=$(dirname -- "$a"); done',
        '  if [[ -d $a && -w $a ]]; then echo "SBG_RUN=creatable $a"; else echo "SBG_RUN=blocked $a"; fi',
        "fi",
    ]
    return "\n".join(lines) + "\n"


def parse_probe(out: str) -> dict[str, str]:
    facts: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("SBG_") and "=" in line:
            key, _, value = line.partition("=")
            facts.setdefault(key[4:], value.strip())
    return facts


def ssh_argv(p: SshProfile, host: str, command: str) -> list[str]:
    """The launcher's ssh command line for one host (SSH_OPTS of the render)."""
    return ["ssh", *(w for line in p.ssh.argv_lines() for w in line), "--", host, command]


def host_rows(p: SshProfile, rank: int, host: str, res: Result, how: str) -> list[Check]:
    """The rows of one host from its probe's result."""
    facts = parse_probe(res.out)
    rows: list[Check] = []
    expected_ssh = f"reachable in batch mode (ConnectTimeout {p.ssh.connect_timeout_s} s)"
    if rank == 0:
        rows.append(skip(f"ssh {host}", expected_ssh, "node 0: runs here, the launcher's host (no ssh)"))
    # ssh's own failure (255), or no answer at all (124, the runner's timeout): it never got to the probe
    if "DIR" not in facts and rank and res.rc in (255, 124):
        rows.append(
            error(
                f"ssh {host}",
                expected_ssh,
                f"ssh failed (exit {res.rc}): {res.message()}",
                f"ssh cannot log in to {host} without a prompt: check ssh.user, ssh.port, ssh.identity_file "
                f"and known_hosts; try `{how}`",
            )
        )
        return rows + [
            skip(f"{c} {host}", "-", "not checked: ssh failed") for c in ("torch", "gpus", "run dir")
        ]
    if rank:
        rows.append(ok(f"ssh {host}", expected_ssh, "logged in"))
    if "DIR" not in facts:  # the probe did not run (no bash there, a timeout, ...)
        rows.append(
            error(
                f"probe {host}",
                "the doctor's probe runs (bash)",
                f"exit {res.rc}: {res.message()}",
                f"the probe did not run on {host}: {res.message()}",
            )
        )
        return rows + [
            skip(f"{c} {host}", "-", "not checked: no probe") for c in ("torch", "gpus", "run dir")
        ]
    if facts["DIR"] != "ok":
        rows.append(
            error(
                f"launch dir {host}",
                "the launch directory at the same path",
                "missing",
                f"{host} has no {Path.cwd()}: every host needs the launch directory at the same path (a shared "
                "filesystem or an identical checkout)",
            )
        )
        return rows + [
            skip(f"{c} {host}", "-", "not checked: no launch directory") for c in ("torch", "gpus", "run dir")
        ]
    # python_env imports torch
    exp_torch = f"python_env ({p.python_env.kind}) imports torch"
    torch_gpus: int | None = None
    if "TORCH" in facts:
        version, _, count = facts["TORCH"].partition(" ")
        torch_gpus = int(count) if count.strip().isdigit() else None
        rows.append(ok(f"torch {host}", exp_torch, f"torch {version} ({facts.get('PY', 'python')})"))
    else:
        why = facts.get("ENV") or facts.get("TORCH_ERR") or "no python"
        rows.append(
            error(
                f"torch {host}",
                exp_torch,
                why,
                f"python_env on {host} cannot import torch ({why}): create the environment there (python_env) "
                "and install torch into it",
            )
        )
    # the GPU count
    want = p.node.gpus
    exp_gpus = f"{want} GPUs (node.gpus)"
    if want == 0:
        rows.append(skip(f"gpus {host}", "CPU site (node.gpus 0)", "-"))
    else:
        if "SMI" in facts and facts["SMI"].isdigit():
            have, source = int(facts["SMI"]), "nvidia-smi -L"
        elif torch_gpus is not None:
            have, source = torch_gpus, "torch.cuda.device_count(); no nvidia-smi"
        else:
            have, source = 0, "no nvidia-smi, and torch did not load"
        found = f"{have} ({source})"
        if have == want:
            rows.append(ok(f"gpus {host}", exp_gpus, found))
        else:
            rows.append(
                error(
                    f"gpus {host}",
                    exp_gpus,
                    found,
                    f"{host} has {have} GPUs, the profile says {want}: the launcher's preflight refuses the host; "
                    "fix node.gpus, or leave the host out (enabled: false)",
                )
            )
    # the run dir
    run = facts.get("RUN", "")
    exp_run = f"paths.run_dir {p.paths.run_dir} writable"
    if run == "writable":
        rows.append(ok(f"run dir {host}", exp_run, "writable"))
    elif run.startswith("creatable "):
        rows.append(ok(f"run dir {host}", exp_run, f"not there yet; {run.split(' ', 1)[1]} is writable"))
    else:
        rows.append(
            error(
                f"run dir {host}",
                exp_run,
                run or "unknown",
                f"{host} cannot write {p.paths.run_dir} ({run or 'no answer'}): fix its permissions or paths.run_dir",
            )
        )
    return rows


def _probe(p: SshProfile, runner: Runner, rank: int, host: str, script: str) -> tuple[Result, str]:
    if rank == 0:
        argv = ["bash", "-c", script]
        how = "bash -c ..."
    else:
        argv = ssh_argv(p, host, "bash -c " + q(script))
        how = shlex.join(ssh_argv(p, host, "true"))
    return runner(argv), how


def secrets_row(p: SshProfile, env: Mapping[str, str]) -> Check:
    """The secrets the launcher sends to every host (:meth:`SshProfile.secret_env`), as the launching shell
    (this one: the doctor runs where the launcher runs) has them; never a value."""
    named = p.secret_env()
    if not named:
        return skip("secrets", "-", "the profile names no secret")
    expected = f"{', '.join(s.name for s in named)} set in the launching shell"
    unset = [s for s in named if not env.get(s.name)]
    missing = [s for s in unset if s.required]
    if missing:
        names = ", ".join(f"{s.name} ({s.key})" for s in missing)
        it, its = ("it", "its value") if len(missing) == 1 else ("them", "their values")
        return error(
            "secrets",
            expected,
            f"unset or empty here: {', '.join(s.name for s in missing)}",
            f"the launch exits 2 before anything starts without {names}: export {it} in the shell that runs "
            f"the launcher ({its} reach every host over ssh's stdin, never a command line or a file)",
        )
    found = (
        f"set here; the launcher sends {'it' if len(named) == 1 else 'them'} to every host over ssh's stdin"
    )
    if unset:
        return warn(
            "secrets", expected, found, f"{', '.join(s.name for s in unset)} unset or empty: optional"
        )
    return ok("secrets", expected, found)


def run_checks(site: LoadedSite, runner: Runner, cwd: Path) -> list[Check]:
    p = site.profile
    assert isinstance(p, SshProfile)
    script = probe_script(p, str(cwd))
    hosts = p.enabled_hosts()
    try:
        with ThreadPoolExecutor(max_workers=min(8, len(hosts))) as pool:
            results = list(pool.map(lambda rh: _probe(p, runner, rh[0], rh[1], script), enumerate(hosts)))
    except CommandMissing as e:
        raise UserError(
            f"{e.name} not found: the doctor reaches the hosts the way the launcher does (install OpenSSH's "
            "client and run it on the launcher's host)"
        ) from None
    rows: list[Check] = []
    for rank, (host, (res, how)) in enumerate(zip(hosts, results, strict=True)):
        rows += host_rows(p, rank, host, res, how)
    for h in p.hosts:
        if not h.enabled:
            rows.append(
                skip(f"host {h.name}", "-", "left out (enabled: false)" + (f": {h.note}" if h.note else ""))
            )
    return [*rows, secrets_row(p, os.environ)]
