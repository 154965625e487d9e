"""The secrets a launch hands to its nodes, and the preflight's bucket check. Torch-free.

A profile never holds a secret, only the names of the environment variables that hold one:
``cross_region.transport.credentials`` (the S3 access key id, secret access key, session token) and
``metrics.wandb_api_key_env`` (the W&B API key). :func:`secret_env` lists them, once, from the model; the
SSH launcher checks them on the launching host before it starts anything and sends their values to each
node over ssh's stdin (templates/ssh-launcher.sh.j2: SECRET_ENV), never on a command line or in a file.
A profile's own list of secrets by name (``slurm.secrets``, ``launch.secrets``) is added by the kind's
``secret_env`` method (:func:`with_listed`). A shared-credentials ``profile`` or no credentials at all (boto3's default chain: the host's own
environment, ~/.aws, instance role) names nothing to send. Where the profile has no ``metrics`` section, the
train config's decides the sinks: :func:`config_metrics` reads it for the W&B key the SSH launcher sends.

:func:`inspect_secrets_file` reads a Slurm site's ``slurm.secrets_file`` here as the job reads it on the node
(``sbatch-gen doctor``'s secrets row); :func:`read_secrets_file` takes the values from it (``sbatch-gen status``
takes the S3 keys from it).

:func:`bucket_check` is the preflight's check that a node reaches the run's bucket with those credentials
(the node program's ``s3_*`` settings, sbatch_gen/node_program.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sbatch_gen.metrics_options import MetricsOptions
from sbatch_gen.xr_options import CrossRegion, S3Transport

CREDENTIALS_KEY = "cross_region.transport.credentials"


class SecretsProfile(Protocol):
    """What the secrets are read from: :class:`sbatch_gen.profiles.base.ProfileBase` has it."""

    @property
    def cross_region(self) -> CrossRegion: ...
    @property
    def metrics(self) -> MetricsOptions | None: ...
    @property
    def trainer(self) -> Any: ...


@dataclass(frozen=True)
class SecretEnv:
    """One environment variable whose value is a secret."""

    name: str  # the variable
    key: str  # the profile field that names it
    required: (
        bool  # True: a launch refuses to start without it; False: sent when set (W&B key, wandb_mode auto)
    )


def s3_transport(xr: CrossRegion) -> S3Transport | None:
    """The S3 transport of an enabled cross_region, else None."""
    return xr.transport if xr.enabled and isinstance(xr.transport, S3Transport) else None


@dataclass(frozen=True)
class ConfigMetrics:
    """The train config's ``metrics`` section, where the trainer takes its sinks from it (:func:`config_metrics`)."""

    path: str  # trainer.config, as the profile writes it
    # None: not known here (the file is not readable here, or its section is not a valid one)
    metrics: MetricsOptions | None

    @property
    def key(self) -> str:
        """The field that names the W&B key's variable, for the messages that name it."""
        return f"metrics.wandb_api_key_env of trainer.config {self.path}"


def config_metrics(p: SecretsProfile, root: Path = Path(".")) -> ConfigMetrics | None:
    """The train config's ``metrics`` section, where it decides the trainer's sinks: the profile has no
    ``metrics`` section (whose --metrics-* flags would replace it), ``trainer.args`` is unset (the fixed
    flags pass ``--config``) and ``trainer.config`` is set; read from ``root`` (relative paths: from the
    directory the launch starts in, as the job resolves them). None where the profile decides.
    ``ConfigMetrics.metrics`` is None when the file is not readable here, or its ``metrics`` section is not
    a valid one (the trainer refuses it at start-up); a config without the section has the defaults (no sink)."""
    from sbatch_gen.errors import UserError
    from sbatch_gen.yamlload import read_mapping

    t = p.trainer
    if p.metrics is not None or t.args is not None or t.config is None:
        return None
    path = root / t.config
    if not path.is_file():
        return ConfigMetrics(t.config, None)
    try:
        data, _ = read_mapping(path, "train config", label=t.config)
        return ConfigMetrics(t.config, MetricsOptions.model_validate(data.get("metrics") or {}))
    except (UserError, OSError, ValueError):
        return ConfigMetrics(t.config, None)


def secret_env(p: SecretsProfile, config: ConfigMetrics | None = None) -> list[SecretEnv]:
    """The variables the profile names as secrets, in the order of the profile, each once.

    S3 (cross_region enabled with the s3 transport): the access key id and secret access key variables, and
    the session token's when the keys are named (the trainer reads it only with them). W&B (metrics.sinks
    has wandb; the profile's metrics section, else the train config's, ``config``: :func:`config_metrics`):
    the API key's variable, required with wandb_mode online, sent when set with auto (unset: the trainer
    writes offline), not at all with offline."""
    out: list[SecretEnv] = []
    t = s3_transport(p.cross_region)
    if t is not None and t.credentials.access_key_id_env is not None:
        c = t.credentials
        for field in ("access_key_id_env", "secret_access_key_env", "session_token_env"):
            name = getattr(c, field)
            if name is not None:
                out.append(SecretEnv(name, f"{CREDENTIALS_KEY}.{field}", True))
    m, key = p.metrics, "metrics.wandb_api_key_env"
    if m is None and config is not None:
        m, key = config.metrics, config.key
    if m is not None and "wandb" in m.sinks and m.wandb_mode != "offline":
        out.append(SecretEnv(m.wandb_api_key_env, key, m.wandb_mode == "online"))
    seen: dict[str, int] = {}
    unique: list[SecretEnv] = []
    for s in out:  # one variable named by two fields: once, required if either requires it
        if s.name in seen:
            i = seen[s.name]
            if s.required and not unique[i].required:
                unique[i] = SecretEnv(s.name, s.key, True)
            continue
        seen[s.name] = len(unique)
        unique.append(s)
    return unique


def with_listed(named: list[SecretEnv], names: Sequence[str], field: str) -> list[SecretEnv]:
    """``named`` (:func:`secret_env`), then the secrets a profile lists by name (``field``: slurm.secrets,
    launch.secrets), each required, keyed ``field[i]``; a name already there, or listed twice, once."""
    have = {s.name for s in named}
    more = [SecretEnv(n, f"{field}[{i}]", True) for i, n in enumerate(names) if n not in have]
    return named + list({s.name: s for s in more}.values())


def bucket_check(xr: CrossRegion, timeout_s: int) -> list[tuple[str, str]]:
    """The preflight's bucket check as node-program settings (NAME, VALUE): a LIST of at most one key under
    the run's prefix, by the trainer's python and boto3, with the credentials the trainer will use, within
    ``timeout_s`` seconds to connect and to read. Empty unless cross_region is enabled with the s3 transport."""
    t = s3_transport(xr)
    if t is None:
        return []
    c = t.credentials
    settings: list[tuple[str, Any]] = [
        ("s3_bucket", t.bucket),
        ("s3_prefix", t.prefix),
        ("s3_endpoint", t.endpoint_url),
        ("s3_addressing", t.addressing_style),
        ("s3_region", t.region_name),
        ("s3_profile", c.profile),
        ("s3_key_env", c.access_key_id_env),
        ("s3_secret_env", c.secret_access_key_env),
        ("s3_token_env", c.session_token_env if c.access_key_id_env else None),
        ("s3_timeout_s", timeout_s),
    ]
    return [(name, str(v)) for name, v in settings if v not in (None, "")]


# A line of a slurm.secrets_file as the job library's load_secrets reads it: NAME=value, an `export ` before it
# allowed; blank lines and # comments skipped.
_SECRETS_LINE = re.compile(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)")
_SKIPPED_LINE = re.compile(r"\s*(?:#.*)?")


def parse_secrets_file(text: str) -> tuple[dict[str, str], list[int]]:
    """A slurm.secrets_file's text as the job library's load_secrets reads it: (NAME -> value, a later line
    winning, a value in matching quotes without them, nothing expanded; the numbers of the lines that are
    not NAME=value)."""
    values: dict[str, str] = {}
    bad: list[int] = []
    for n, line in enumerate(text.split("\n"), 1):
        if _SKIPPED_LINE.fullmatch(line):
            continue
        m = _SECRETS_LINE.fullmatch(line)
        if m is None:
            bad.append(n)
            continue
        value = m.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[m.group(1)] = value
    return values, bad


def secrets_file_path(where: str, cwd: Path) -> Path:
    """slurm.secrets_file on this host: ``~/`` is the user's home directory, a relative path is from ``cwd``
    (the directory the job is submitted from)."""
    return Path.home() / where[2:] if where.startswith("~/") else cwd / where


@dataclass(frozen=True)
class SecretsFile:
    """A slurm.secrets_file as this host sees it, checked as the job's load_secrets checks it on the node.
    ``refused``: why the job would stop on the file itself ("missing", "unreadable", "owner", "mode",
    "line"; None: it reads it), ``detail`` says more (the error, the owner's uid, the number of the line that
    is not NAME=value); ``values``: the named variables it gives a non-empty value. Never printed whole."""

    path: Path
    refused: str | None = None
    detail: str = ""
    mode: int = 0
    values: dict[str, str] = field(default_factory=dict, repr=False)


def inspect_secrets_file(where: str, named: Sequence[SecretEnv], cwd: Path = Path(".")) -> SecretsFile:
    """slurm.secrets_file ``where`` read here as the job reads it on its node (load_secrets): it must belong to
    this user and be readable by no one else, and every line must be NAME=value (``export`` allowed)."""
    path = secrets_file_path(where, cwd)
    try:
        st = path.stat()
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return SecretsFile(path, "missing")
    except OSError as e:
        return SecretsFile(path, "unreadable", e.strerror or str(e))
    mode = st.st_mode & 0o777
    if st.st_uid != os.getuid():
        return SecretsFile(path, "owner", str(st.st_uid), mode)
    if mode & 0o077:
        return SecretsFile(path, "mode", "", mode)
    values, bad = parse_secrets_file(text)
    if bad:
        return SecretsFile(path, "line", str(bad[0]), mode)  # the line itself is never said
    return SecretsFile(path, None, "", mode, {s.name: values[s.name] for s in named if values.get(s.name)})


def read_secrets_file(where: str, named: Sequence[SecretEnv], cwd: Path = Path(".")) -> dict[str, str]:
    """The values of the variables ``named`` from slurm.secrets_file ``where`` (:func:`inspect_secrets_file`),
    every required one with a non-empty value. Raises ValueError with one line (naming the file, never a
    value) when it cannot be used."""
    f = inspect_secrets_file(where, named, cwd)
    path = f.path
    required = [s for s in named if s.required]
    if f.refused == "missing":
        if not required:
            return {}
        wanted = ", ".join(f"{s.name} ({s.key})" for s in required)
        raise ValueError(f"no secrets file {path}: write NAME=value lines for {wanted} into it, chmod 600")
    if f.refused == "unreadable":
        raise ValueError(f"cannot read secrets file {path}: {f.detail}")
    if f.refused == "owner":
        raise ValueError(f"secrets file {path} belongs to uid {f.detail}, not to you (uid {os.getuid()})")
    if f.refused == "mode":
        raise ValueError(f"secrets file {path} is mode {f.mode:o}: others may read it; chmod 600 {path}")
    if f.refused == "line":
        raise ValueError(f"secrets file {path}, line {f.detail}: not NAME=value")
    missing = [f"{s.name} ({s.key})" for s in required if s.name not in f.values]
    if missing:
        raise ValueError(f"secrets file {path} has no value for {', '.join(missing)}")
    return f.values
