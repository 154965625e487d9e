"""The train config (``configs/*.yaml``): one pydantic model, unknown keys rejected.

Torch-free. Read by the same loader as the site profiles (:mod:`sbatch_gen.yamlload`): the same limits,
and the same errors, a :class:`~sbatch_gen.errors.UserError` of ``file:line: field: message`` lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..metrics_options import MetricsOptions
from ..strict import StrictModel
from ..xr_options import outer_step_warnings
from ..yamlload import load_model
from .shapes import parameter_shapes
from .xr.fragments import rounds_through, too_few


class ModelConfig(StrictModel):
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

    def parameter_names(self) -> list[str]:
        """The GPT's trainable parameters, as ``named_parameters()`` names them (the model is built with
        torch; validate needs the names without it: Streaming DiLoCo's fragments, :mod:`.xr.fragments`)."""
        return [name for name, _ in parameter_shapes(self)]

    @field_validator("n_heads")
    @classmethod
    def _heads_divide(cls, v: int, info: ValidationInfo) -> int:
        d = info.data.get("d_model")
        if d is not None and d % v:
            raise ValueError(f"d_model {d} is not divisible by n_heads {v}")
        return v


class DataConfig(StrictModel):
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


class ProfileConfig(StrictModel):
    """A torch profiler trace of a few steps (``train.profile``)."""

    start_step: int = Field(ge=1, description="The first step profiled.")
    steps: int = Field(default=3, ge=1, le=1000, description="How many steps, from start_step on.")


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class CompileConfig(StrictModel):
    """``train.compile``: torch.compile per transformer block (``true``/``false`` is short for
    ``{enabled: true/false}``)."""

    enabled: bool = Field(
        default=False,
        description="torch.compile each transformer block in place (one graph for all: the first step "
        "compiles it), before DDP/FSDP wrap the model; parameter names and checkpoints stay the eager "
        "model's. Off, with one line, where the backend cannot compile (no C++ compiler on the CPU, no "
        "Triton on CUDA).",
    )
    mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        default="default",
        description="torch.compile's mode: default, or max-autotune-no-cudagraphs (inductor benchmarks "
        "matmul and Triton configurations while it compiles: a longer first step, maybe faster ones "
        "after). The CUDA-graph modes (reduce-overhead, max-autotune) are not offered: a graph replays "
        "into buffers its next replay overwrites, and per-block graphs under activation checkpointing, "
        "DDP or FSDP2 would need every block's outputs copied out or kept apart.",
    )


class TrainSection(StrictModel):
    steps: int = Field(
        ge=1, le=100_000_000, description="Total optimizer steps (the LR schedule spans these)."
    )
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
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description="torch.compile each transformer block in place: {enabled, mode}, or true/false for "
        "enabled alone (see CompileConfig).",
    )
    profile: ProfileConfig | None = Field(
        default=None,
        description="Off by default. {start_step, steps}: record steps start_step..start_step+steps-1 with "
        "the torch profiler (CPU, and CUDA kernels on a GPU) and write one Chrome trace per rank to "
        "<run-dir>/profile/rank<R>.steps-<first>-<last>.json (Perfetto or chrome://tracing opens it). The "
        "profiled steps run slower; the losses are the same. A process that starts inside the window "
        "(resumed) records what is left of it.",
    )
    peak_tflops: float | None = Field(
        default=None,
        gt=0,
        description="Dense BF16 peak per device (TFLOP/s) for MFU/HFU. Unset: taken from "
        "the GPU's name (metrics.PEAK_BF16_FLOPS), none on CPU; set it for a GPU the table does not know.",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_shorthand(cls, v):
        if isinstance(v, bool):
            return {"enabled": v}
        if v is None or not isinstance(v, dict):
            raise ValueError(
                f"must be true, false or a mapping {{enabled, mode}} (got {v!r}); modes: "
                + ", ".join(COMPILE_MODES)
            )
        return v


class OptimConfig(StrictModel):
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


class CheckpointConfig(StrictModel):
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


class DistConfig(StrictModel):
    backend: Literal["auto", "nccl", "gloo"] = Field(
        default="auto", description="auto: nccl on CUDA, else gloo."
    )
    timeout_s: float = Field(default=600, gt=0, le=86_400, description="Collective timeout.")


class ParallelismConfig(StrictModel):
    """How the ranks of one region share the model (cross-region sync is separate: ``cross_region``)."""

    kind: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="ddp (default): every rank holds the whole model, its gradients and its AdamW state "
        "(16 B/param in fp32) and the gradients are all-reduced; no wrapper at world size 1. fsdp: FSDP2 "
        "(torch fully_shard on every transformer block and on the root): parameters, gradients and AdamW "
        "state are split over the region's ranks (16/N B/param), each block's parameters are all-gathered "
        "for its forward and backward and the gradients reduce-scattered; also at world size 1.",
    )
    cpu_offload: bool = Field(
        default=False,
        description="fsdp only (default false): keep the sharded parameters, gradients and AdamW state in "
        "host memory (FSDP2's CPUOffloadPolicy, pinned on CUDA); each block is copied to the device for its "
        "forward and backward, and the optimizer step runs on the CPU.",
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="fsdp only (default true): free each block's gathered parameters after its forward and "
        "gather them again for its backward. false: keep them until the backward (one all-gather fewer per "
        "block and micro-batch; every block's full parameters held between forward and backward).",
    )
    grad_accumulation: Literal["sharded", "unsharded"] = Field(
        default="sharded",
        description="fsdp with train.grad_accum > 1. sharded (default): reduce-scatter after every "
        "micro-batch and accumulate the 1/N gradient shards. unsharded: accumulate the full gradients on "
        "each rank and reduce-scatter once per step (grad_accum times fewer reduce-scatters, full-size "
        "gradients held, as DDP's no_sync).",
    )

    @field_validator("cpu_offload", "reshard_after_forward", "grad_accumulation")
    @classmethod
    def _fsdp_only(cls, v: object, info: ValidationInfo) -> object:
        default = cls.model_fields[str(info.field_name)].default
        if v != default and info.data.get("kind") == "ddp":
            said = str(v).lower() if isinstance(v, bool) else v
            raise ValueError(
                f"{said} needs parallelism.kind: fsdp (kind is ddp: every rank holds the whole model)"
            )
        return v


class TrainConfig(StrictModel):
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainSection
    optim: OptimConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    parallelism: ParallelismConfig = Field(
        default_factory=ParallelismConfig,
        description="In-region data parallelism: DDP (default) or FSDP2, with their options.",
    )
    metrics: MetricsOptions = Field(
        default_factory=MetricsOptions,
        description="Metric sinks besides metrics.jsonl; the --metrics-* flags (a site profile's metrics "
        "section) replace this section.",
    )
    run_dir: str = Field(default="runs/default", min_length=1, description="Default for --run-dir.")

    @model_validator(mode="after")
    def _profile(self) -> TrainConfig:
        p = self.train.profile
        if p is not None and p.start_step > self.train.steps:
            raise ValueError(
                f"train.profile.start_step {p.start_step} is past train.steps {self.train.steps}: nothing "
                "would be profiled"
            )
        return self

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.optim.warmup_steps >= self.train.steps:
            raise ValueError(
                f"optim.warmup_steps {self.optim.warmup_steps} must be below train.steps {self.train.steps}"
            )
        return self


def load_config(path: str | Path) -> TrainConfig:
    """Load and validate a train config; raise :class:`~sbatch_gen.errors.UserError` (one
    ``file:line: field: message`` per problem; the file named as ``path`` is written)."""
    return load_model(TrainConfig, Path(path), "train config", label=str(path))


class XRProblem(str):
    """One message of :func:`xr_problems`; ``field`` is the ``cross_region`` field it is about, so
    ``sbatch-gen validate`` can point at the line that sets it. A plain ``str`` everywhere else."""

    field: str

    def __new__(cls, field: str, text: str) -> XRProblem:
        self = super().__new__(cls, text)
        self.field = field
        return self


def xr_problems(
    cfg: TrainConfig, xr, end_step: int | None = None, config_name: str | None = None
) -> tuple[list[XRProblem], list[XRProblem]]:
    """Check a train config against cross-region settings (``xr_options.CrossRegion``).

    Returns (errors, warnings), each an :class:`XRProblem` naming its ``cross_region`` field. Torch-free,
    so ``sbatch-gen validate`` runs it at review time and the trainer again at start-up. ``end_step``: a
    ``--max-steps`` cap; ``config_name``: the train config's path, named in the messages.

    grad mode cannot fast-forward: a region resumed from its checkpoint re-enters every round (= step)
    since, so ``keep_rounds`` must cover ``checkpoint.every``. DiLoCo needs no such bound: a region's
    rounds are deleted only once a complete outer snapshot covers them, and a snapshot only once a newer
    one is complete, so a region resumed from any checkpoint reaches the run (replaying rounds, or the
    newest snapshot and the rounds after it). What DiLoCo needs is that a snapshot is written at all.
    """
    errors: list[XRProblem] = []
    warnings: list[XRProblem] = []
    if not xr.enabled:
        return errors, warnings
    in_cfg = f" in {config_name}" if config_name else ""
    h = xr.inner_steps
    if xr.sync == "grad":
        errors += _grad_problems(cfg, xr, end_step, in_cfg)
    else:
        errors += _diloco_problems(cfg, xr, in_cfg)
    warnings += [XRProblem(f, m) for f, m in outer_step_warnings(xr)]
    if xr.sync == "diloco" and cfg.train.steps < h:
        warnings.append(
            XRProblem(
                "inner_steps",
                f"train.steps ({cfg.train.steps}{in_cfg}) is fewer than cross_region.inner_steps ({h}): the run "
                "ends before its first round, and the regions never synchronise. Lower inner_steps, or raise "
                "train.steps.",
            )
        )
    elif xr.sync == "diloco" and cfg.train.steps % h:
        warnings.append(
            XRProblem(
                "inner_steps",
                f"train.steps ({cfg.train.steps}{in_cfg}) is not a multiple of cross_region.inner_steps "
                f"({h}): the last {cfg.train.steps % h} steps stay local to each region. Make train.steps a "
                "multiple of inner_steps to end on a synchronised model.",
            )
        )
    return errors, warnings


def _grad_problems(cfg: TrainConfig, xr, end_step: int | None, in_cfg: str) -> list[XRProblem]:
    """grad mode: keep_rounds must cover the rounds between two checkpoints (no fast-forward)."""
    errors: list[XRProblem] = []
    # No replay can span more steps than the run has (end_step: a --max-steps cap).
    every = min(cfg.checkpoint.every, end_step or cfg.train.steps)
    if xr.keep_rounds < every:
        errors.append(
            XRProblem(
                "keep_rounds",
                f"cross_region.keep_rounds ({xr.keep_rounds}) must cover the {every} rounds between two "
                f"checkpoints (checkpoint.every {every} steps{in_cfg}, one round per step with sync: grad): "
                "a region resumed after a crash re-enters those rounds and grad mode cannot fast-forward. "
                f"Raise keep_rounds to {every}, or lower checkpoint.every to {xr.keep_rounds}.",
            )
        )
    return errors


def _diloco_problems(cfg: TrainConfig, xr, in_cfg: str) -> list[XRProblem]:
    """DiLoCo: an outer snapshot is written at all, and the model has blocks enough for the fragments."""
    errors: list[XRProblem] = []
    h = xr.inner_steps
    f = xr.fragment_count
    rounds = rounds_through(cfg.train.steps, h, f)
    per = f"// inner_steps {h}" if f == 1 else f"with fragments {f}: {f} rounds per inner_steps {h}"
    if rounds >= 1 and xr.snapshot_every > rounds:
        errors.append(
            XRProblem(
                "snapshot_every",
                f"cross_region.snapshot_every ({xr.snapshot_every}) is more than the {rounds} outer rounds of "
                f"the run (train.steps {cfg.train.steps}{in_cfg} {per}): no outer snapshot is "
                "ever written, and rounds are deleted only once a snapshot covers them, so keep_rounds never "
                "takes effect and the mailbox keeps every region's payload of every round until someone "
                f"deletes it by hand. Set snapshot_every to at most {rounds}.",
            )
        )
    why = too_few(cfg.model.parameter_names(), f) if f > 1 else None
    if why is not None:
        errors.append(
            XRProblem("fragments", f"cross_region.{why} (model.n_layers {cfg.model.n_layers}{in_cfg})")
        )
    return errors
