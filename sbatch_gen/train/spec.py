"""The run spec: everything one trainer process is asked to do, merged once and frozen.

Torch-free. :meth:`RunSpec.from_args` is the only place where the trainer's flags meet the train config
and the cross-region options: ``--run-dir`` and ``--data-path`` are merged into the config (``run_dir``,
``data.path``), ``--max-steps`` caps the end step, the ``--xr-*`` flags become a validated
:class:`~sbatch_gen.xr_options.CrossRegion`, and the ``--metrics-*`` flags, when given, replace the
config's ``metrics`` section. Below the entry point nothing reads the flags again.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pydantic

from .. import metrics_options, xr_options
from ..errors import UserError
from .api import CrossRegionError, cross_region_from_args, xr_flags_given
from .config import TrainConfig, load_config, xr_problems
from .signals import resolve_stop_file

EXIT_CONFIG = 2  # a bad config or flag; also: the run dir is leased by another live trainer (lease.json)


class SpecError(Exception):
    """The flags or the train config they name are invalid. ``str(err)`` is what the trainer prints
    before it exits :data:`EXIT_CONFIG`: a header line, then one line per problem."""


@dataclass(frozen=True)
class RunSpec:
    """One trainer process's run, resolved.

    ``cfg`` is the effective train config: ``cfg.run_dir`` and ``cfg.data.path`` already hold the
    ``--run-dir`` / ``--data-path`` overrides. ``end_step`` is ``train.steps`` capped by ``--max-steps``
    (the LR schedule still spans ``train.steps``). ``xr_warnings`` are the cross-region settings that
    ``sbatch-gen validate`` rejects but a running trainer only warns about (see :func:`xr_problems`).
    """

    config_path: str
    cfg: TrainConfig
    xr: xr_options.CrossRegion
    resume: str  # "auto", "none", or the path of a checkpoint
    end_step: int
    stop_file: Path | None
    xr_warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.end_step <= self.cfg.train.steps:
            raise ValueError(f"end_step {self.end_step} is outside 0..train.steps ({self.cfg.train.steps})")
        if not self.resume:
            raise ValueError("resume must be 'auto', 'none' or a checkpoint path")

    @property
    def run_dir(self) -> Path:
        """Checkpoints, metrics.jsonl, summary.json and the lease."""
        return Path(self.cfg.run_dir)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSpec:
        """Load ``--config``, merge the flags into it and validate the cross-region flags.

        Raises :class:`SpecError` (the config's ``file:line: field`` problems, or one line per bad
        ``--xr-*`` flag). The stop file is ``--stop-file``, else ``$SBATCH_GEN_STOP_FILE``, read now."""
        try:
            loaded = load_config(args.config)
        except UserError as e:
            raise SpecError(f"config error:\n{e}") from None
        try:  # the --xr-* flags, else the SBATCH_GEN_XR_* environment: as any trainer reads them
            xr, _ = cross_region_from_args(namespace=args)
        except CrossRegionError as e:
            raise SpecError(
                f"cross-region {'flag' if xr_flags_given(args) else 'environment'} error:\n{e}"
            ) from None
        try:
            metrics = metrics_options.from_namespace(args)
        except pydantic.ValidationError as e:
            raise SpecError("metrics flag error:\n" + metrics_options.flag_errors(e)) from None
        cfg = loaded.model_copy(
            update={
                "run_dir": args.run_dir or loaded.run_dir,
                "data": loaded.data.model_copy(update={"path": args.data_path or loaded.data.path}),
                "metrics": metrics or loaded.metrics,
            }
        )
        steps = cfg.train.steps
        end_step = steps if args.max_steps is None else min(steps, args.max_steps)
        errors, warnings = xr_problems(cfg, xr, end_step)
        return cls(
            config_path=str(args.config),
            cfg=cfg,
            xr=xr,
            resume=args.resume,
            end_step=end_step,
            stop_file=resolve_stop_file(args.stop_file),
            xr_warnings=tuple(str(w) for w in errors + warnings),
        )
