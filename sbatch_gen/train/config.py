"""The train config (``configs/*.yaml``): one pydantic model, unknown keys rejected.

Torch-free. Errors name ``file:line: field`` like the site profiles do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .yamlconf import ConfigError, load_model

__all__ = ["ConfigError", "TrainConfig", "load_config"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """A GPT-style decoder-only transformer."""

    n_layers: int = Field(ge=1, le=512, description="Transformer blocks.")
    d_model: int = Field(ge=8, le=65536, description="Width of the residual stream.")
    n_heads: int = Field(ge=1, le=1024, description="Attention heads; must divide d_model.")
    vocab_size: int = Field(default=256, ge=256, le=1_000_000, description="Byte tokens need >= 256.")
    seq_len: int = Field(ge=2, le=1_048_576, description="Tokens per sequence (context length).")
    mlp_ratio: int = Field(default=4, ge=1, le=64, description="MLP hidden width / d_model.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability (0 = off).")
    tie_embeddings: bool = Field(default=True, description="Share the input embedding and output head.")
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each block's forward during backward (HFU > MFU)."
    )

    @field_validator("n_heads")
    @classmethod
    def _heads_divide(cls, v: int, info: ValidationInfo) -> int:
        d = info.data.get("d_model")
        if d is not None and d % v:
            raise ValueError(f"d_model {d} is not divisible by n_heads {v}")
        return v


class DataConfig(_Strict):
    path: str = Field(
        default="data",
        min_length=1,
        description="This region's token shard (a .bin file), or a directory holding <region>.bin; "
        "a missing shard in a directory is prepared on demand from `source`.",
    )
    source: Literal["python-stdlib", "common-licenses"] = Field(
        default="python-stdlib", description="Text that ships with the machine, used to prepare shards."
    )
    max_bytes: int = Field(
        default=0, ge=0, description="Cap on the corpus size when preparing (0 = everything)."
    )


class TrainSection(_Strict):
    steps: int = Field(ge=1, le=100_000_000, description="Total optimizer steps (the LR schedule spans these).")
    batch_size: int = Field(ge=1, le=65536, description="Sequences per rank per micro-batch.")
    grad_accum: int = Field(default=1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    seed: int = Field(default=1234, ge=0, lt=2**63)
    log_every: int = Field(default=10, ge=1, description="Write a metrics record every this many steps.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto: bf16 autocast on CUDA, fp32 on CPU."
    )
    deterministic: Literal["auto", "on", "off"] = Field(
        default="auto", description="torch.use_deterministic_algorithms; auto: on for CPU only."
    )
    peak_tflops: float | None = Field(
        default=None, gt=0, description="Override the device's dense BF16 peak used for MFU."
    )


class OptimConfig(_Strict):
    lr: float = Field(gt=0, le=10, description="Peak learning rate (AdamW).")
    min_lr: float = Field(default=0.0, ge=0, description="Floor of the cosine decay.")
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0, le=1)
    grad_clip: float = Field(default=1.0, ge=0, description="Max global grad norm (0 = no clipping).")

    @model_validator(mode="after")
    def _floor(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} is above lr {self.lr}")
        return self


class CheckpointConfig(_Strict):
    every: int = Field(default=100, ge=1, description="Save every this many steps (and at the end/stop).")
    keep_last: int = Field(default=3, ge=1, le=10_000, description="Complete checkpoints to keep.")
    async_save: bool = Field(
        default=False, description="Save in the background (torch.distributed.checkpoint.async_save)."
    )
    verify: Literal["size", "crc32"] = Field(
        default="size",
        description="What the completion marker records to detect damaged files: sizes, or sizes and CRC32 "
        "(rank 0 reads the checkpoint back once after saving and before resuming).",
    )
    export_safetensors: bool = Field(
        default=True, description="Write <run-dir>/model.safetensors from rank 0 at the end."
    )


class DistConfig(_Strict):
    backend: Literal["auto", "nccl", "gloo"] = Field(default="auto", description="auto: nccl on CUDA, else gloo.")
    timeout_s: float = Field(default=600, gt=0, le=86_400, description="Collective timeout.")


class TrainConfig(_Strict):
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainSection
    optim: OptimConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    run_dir: str = Field(default="runs/default", min_length=1, description="Default for --run-dir.")

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.optim.warmup_steps >= self.train.steps:
            raise ValueError(
                f"optim.warmup_steps {self.optim.warmup_steps} must be below train.steps {self.train.steps}"
            )
        return self


def load_config(path: str | Path) -> TrainConfig:
    """Load and validate a train config; raise ConfigError (``file:line: field: message``)."""
    return load_model(TrainConfig, path)


def xr_problems(cfg: TrainConfig, xr, end_step: int | None = None) -> tuple[list[str], list[str]]:
    """Check a train config against cross-region settings (``xr_options.CrossRegion``).

    Returns (errors, warnings). Torch-free, so ``sbatch-gen validate`` runs it at review time and the
    trainer again at start-up.
    """
    errors: list[str] = []
    warnings: list[str] = []
    if not xr.enabled:
        return errors, warnings
    # No replay can span more steps than the run has (end_step: a --max-steps cap).
    every = min(cfg.checkpoint.every, end_step or cfg.train.steps)
    # A region resumed from its last checkpoint replays the rounds since then and needs them in the mailbox.
    rounds_between = -(-every // xr.inner_steps) if xr.sync == "diloco" else every
    if xr.keep_rounds < rounds_between:
        errors.append(
            f"cross_region.keep_rounds ({xr.keep_rounds}) must cover the {rounds_between} rounds between two "
            f"checkpoints (checkpoint.every {every}"
            + (f" / inner_steps {xr.inner_steps}" if xr.sync == "diloco" else " steps, one round per step")
            + "): a region resumed after a crash replays them. Raise keep_rounds or checkpoint more often."
        )
    if xr.sync == "diloco" and cfg.train.steps % xr.inner_steps:
        warnings.append(
            f"train.steps ({cfg.train.steps}) is not a multiple of cross_region.inner_steps "
            f"({xr.inner_steps}): the last {cfg.train.steps % xr.inner_steps} steps stay local to each region"
        )
    return errors, warnings
