"""sbatch-gen: deterministic, reviewable launch scripts for (cross-region) training, and the trainer they launch."""

__version__ = "0.1.0"
