"""Metric sinks: one typed model shared by the train config, the site profile and the trainer.

Torch-free. The train config's ``metrics`` section and the site profile's ``metrics`` section are both
:class:`MetricsOptions`; the renderer turns the profile's into ``--metrics-*`` trainer flags
(:func:`to_argv`), which override the train config's section as a whole. Secrets are never given: the W&B
key is read from the environment variable named by ``wandb_api_key_env``.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import pydantic
from pydantic import Field, field_validator

from sbatch_gen.strict import StrictModel
from sbatch_gen.xr_options import ENV_NAME_RE, NAME_RE

SinkName = Literal["tensorboard", "wandb", "prometheus"]
_name = Annotated[str, Field(pattern=NAME_RE)]


class MetricsOptions(StrictModel):
    """Where the trainer's metrics go besides ``<run-dir>/metrics.jsonl`` (always written)."""

    sinks: list[SinkName] = Field(
        default_factory=list,
        description="Sinks to write: tensorboard (event files in <run-dir>/tensorboard), wandb (one run "
        "per region, grouped by the run id), prometheus (a node_exporter textfile). Rank 0 of each "
        "region writes; a sink that fails is logged once and disabled, training goes on.",
    )
    prometheus_every: int = Field(
        default=10, ge=1, le=1_000_000, description="Rewrite the Prometheus file every this many steps."
    )
    prometheus_dir: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="Directory of the Prometheus textfile (node_exporter's --collector.textfile.directory "
        "on the node); default: the run dir. The file is sbatch_gen_<run_id>_<region>.prom.",
    )
    wandb_project: _name = Field(default="sbatch-gen", description="W&B project.")
    wandb_entity: _name | None = Field(default=None, description="W&B entity (team); default: the key's.")
    wandb_api_key_env: Annotated[str, Field(pattern=ENV_NAME_RE)] = Field(
        default="WANDB_API_KEY",
        description="Name of the environment variable holding the W&B API key (never the key itself).",
    )
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        default="auto",
        description="auto: online when the key's variable is set, else offline (files under "
        "<run-dir>/wandb, to `wandb sync` later).",
    )
    wandb_init_timeout_s: float = Field(
        default=60,
        gt=0,
        le=3600,
        description="How long to wait for W&B at the start before going without it.",
    )

    @field_validator("sinks")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        dup = sorted({s for s in v if v.count(s) > 1})
        if dup:
            raise ValueError(f"listed twice: {', '.join(dup)}")
        return v


_FLAGS = {name: "--metrics-" + name.replace("_", "-") for name in MetricsOptions.model_fields}


def to_argv(opts: MetricsOptions | None) -> list[str]:
    """Trainer flags for a profile's ``metrics`` section (empty without one). Every field is spelled out,
    so a render never depends on the trainer's defaults."""
    if opts is None:
        return []
    argv: list[str] = []
    for name, flag in _FLAGS.items():
        v = getattr(opts, name)
        if v is None:
            continue
        argv += [flag, ",".join(v) if isinstance(v, list) else repr(v) if isinstance(v, float) else str(v)]
    return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("metric sinks (override the train config's metrics section)")
    for name, flag in _FLAGS.items():
        g.add_argument(flag, dest="metrics_" + name, default=None)


def flag_errors(e: pydantic.ValidationError) -> str:
    """One ``--metrics-flag: message`` line per problem of :func:`from_namespace`'s error."""
    lines = []
    for err in e.errors():
        name = next((x for x in err["loc"] if isinstance(x, str)), None)
        lines.append(f"{_FLAGS.get(name, '--metrics-*') if name else '--metrics-*'}: {err['msg']}")
    return "\n".join(lines)


def from_namespace(ns: argparse.Namespace) -> MetricsOptions | None:
    """The options the --metrics-* flags give, or None when none was given (raises
    pydantic.ValidationError)."""
    given = {name: v for name in _FLAGS if (v := getattr(ns, "metrics_" + name)) is not None}
    if not given:
        return None
    if "sinks" in given:
        given["sinks"] = [s for s in given["sinks"].split(",") if s]
    return MetricsOptions.model_validate(given)
