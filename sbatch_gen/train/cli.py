"""The trainer's flags (the script <-> trainer contract). Torch-free."""

from __future__ import annotations

import argparse

from .. import metrics_options, xr_options


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sbatch_gen.train",
        description="Train the demo GPT with DDP (torchrun or one process); checkpoints, auto-resume, "
        "graceful stop (exit 42 = checkpointed, requeue me).",
    )
    ap.add_argument("--config", required=True, help="train config YAML (configs/*.yaml)")
    ap.add_argument(
        "--resume",
        default="auto",
        help="auto: newest complete checkpoint in the run dir, else fresh; none: fresh; PATH: that checkpoint",
    )
    ap.add_argument(
        "--run-dir", default=None, help="checkpoints, metrics.jsonl, summary.json (default: config run_dir)"
    )
    ap.add_argument(
        "--data-path", default=None, help="this region's shard file or shard directory (overrides data.path)"
    )
    ap.add_argument(
        "--stop-file", default=None, help="stop when this file appears (default: $SBATCH_GEN_STOP_FILE)"
    )
    ap.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="end after this step (<= train.steps; the LR schedule still spans train.steps)",
    )
    xr_options.add_arguments(ap)
    metrics_options.add_arguments(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 0:
        ap.error("--max-steps must be >= 0")
    return args
