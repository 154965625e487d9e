"""Memory per rank of the production islands, analytic (issue 30, item 3): HBM and host bytes per rank for
DDP, FSDP and FSDP with CPU offload, for a 1B, 7B and 30B model; the largest model each island can train
in each mode, and the island that binds the run. Nothing is measured: every figure follows from the
inputs stated here (bytes per parameter, capacities, activations, allowances).

What comes from the project instead of from this file: the islands (nodes, GPUs per node, GPU type and
the ``cross_region`` settings) from the production profiles ``sites/eu.yaml`` and ``sites/us.yaml``;
whether checkpoints are staged in host memory (``checkpoint.async_save``) from their train config;
parameter counts from the trainer's GPT built on the meta device, and FLOPs per token from the function
its MFU uses; the outer state a DiLoCo leader holds from the sync classes' own buffer lists, where it
lives from the trainer's ``outer_device`` rule, and a payload's size from the mailbox protocol.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sbatch_gen.loader import load_site
from sbatch_gen.profiles.slurm import SlurmProfile
from sbatch_gen.train.config import ModelConfig, load_config
from sbatch_gen.train.model import GPT, flops_per_token
from sbatch_gen.train.xr.protocol import wire_nbytes
from sbatch_gen.train.xr.sync import outer_placement
from sbatch_gen.xr_options import CrossRegion

from .common import REPO, Result, fmt

GB = 1e9  # the table's unit, as the datasheets count
SITES = ("eu", "us")  # the production profiles, in sites/
MODES = ("ddp", "fsdp", "fsdp+offload")

# -- capacities ------------------------------------------------------------------------------------------
# HBM per GPU and host memory per node, by the profiles' slurm.gpu_type: (bytes, source).
HBM = {
    "h200": (141 * GB, "H200 datasheet: 141 GB HBM3e"),
    "gh200": (96 * GB, "GH200 datasheet: 96 GB HBM3"),
}
HOST = {
    "h200": (2000 * GB, "ASSUMPTION: 2 TB, a typical 8 x H200 node; not from the site"),
    "gh200": (480 * GB, "GH200 datasheet: 480 GB LPDDR5X (Grace), over NVLink-C2C"),
}
# What the table leaves out, as flat allowances taken off the capacities (estimates, not measured): per
# GPU the CUDA context (~0.5-1 GB), NCCL's buffers (~1-2 GB) and the caching allocator's fragmentation
# (a few GB); per node the OS, the data loaders and the processes' own host memory.
HBM_RESERVE = 8 * GB
HOST_RESERVE = 64 * GB

# -- bytes per parameter ---------------------------------------------------------------------------------
FP32, BF16 = 4, 2
ADAMW = 2 * FP32  # m and v, fp32
# DDP, every rank, in HBM: the fp32 parameters, their bf16 copies (autocast's weight cache, held through
# the forward), the fp32 gradients (DDP's buckets), AdamW
DDP_ITEMS = {
    "parameters fp32": FP32,
    "parameters bf16 copies": BF16,
    "gradients fp32": FP32,
    "AdamW m, v": ADAMW,
}
# FSDP, each rank its 1/W shard of: the fp32 parameters, the fp32 gradients, AdamW (HBM; host with offload)
FSDP_ITEMS = {"parameters fp32": FP32, "gradients fp32": FP32, "AdamW m, v": ADAMW}
# FSDP's gathered groups, per parameter of a group: the bf16 parameter, its bf16 gradient, the fp32
# reduce-scatter input. Offload adds, per parameter of the rank's 1/W of it, the fp32 shard copied in and
# the fp32 gradient shard before it is copied out.
GATHERED = BF16 + BF16 + FP32
OFFLOAD_COPIES = FP32 + FP32
PREFETCH = 2  # blocks gathered at once: the one computed and the next; the root group (embeddings,
# final norm, head) stays gathered through the step
SAVED = FP32 + ADAMW  # a checkpoint per parameter: the fp32 parameters and AdamW's m, v
OUTER_SAVED = 2 * FP32  # theta_outer and momentum: what a checkpoint and an outer snapshot hold of it

# -- activations (per rank, activation checkpointing on) ------------------------------------------------
SEQ_LEN = 4096
VOCAB = 32000
MICRO_BATCH = 1  # sequences per rank per micro-batch
RESIDUAL = FP32  # per element of each block's input, kept for the recompute (fp32 under autocast)
BLOCK_ACTS = 34  # bytes per token and unit of d_model while one block is recomputed: Korthikanti et al.
# 2022 (bf16, dropout masks included), without the s^2 attention term a fused attention kernel never stores
LOGITS = 14  # per token and vocabulary entry: bf16 logits 2, the fp32 copy the loss takes 4, its
# log-softmax kept for the backward 4, their gradient 4


@dataclass(frozen=True)
class Shape:
    """A model width (and the depth of the open model it stands for) in the trainer's GPT."""

    name: str
    like: str
    n_layers: int
    d_model: int
    n_heads: int

    def config(self, n_layers: int) -> ModelConfig:
        return ModelConfig(
            n_layers=n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            vocab_size=VOCAB,
            seq_len=SEQ_LEN,
            tie_embeddings=False,
            activation_checkpointing=True,
        )


# Open models' widths and depths; the trainer's block (4x GELU MLP) has their 12 d^2 parameters per block.
SHAPES = (
    Shape("1B", "TinyLlama-1.1B", 22, 2048, 32),
    Shape("7B", "Llama-2-7B", 32, 4096, 32),
    Shape("30B", "LLaMA-30B", 60, 6656, 52),
)
MAX_LAYERS = next(m.le for m in ModelConfig.model_fields["n_layers"].metadata if hasattr(m, "le"))


@dataclass(frozen=True)
class Counts:
    """A width's parameters: outside the blocks (embeddings, final norm, head), per block, and the part
    the MFU count leaves out (``num_params(exclude_embeddings=True)``)."""

    outside: int
    block: int
    embeddings: int


@functools.cache
def counts(shape: Shape) -> Counts:
    """From the trainer's GPT, built on the meta device (no memory) with 1 and 2 blocks."""

    def built(n_layers: int) -> tuple[int, int]:
        with torch.device("meta"):
            m = GPT(shape.config(n_layers))
        return m.num_params(), m.num_params(exclude_embeddings=True)

    (one, one_no_emb), (two, _) = built(1), built(2)
    return Counts(outside=2 * one - two, block=two - one, embeddings=one - one_no_emb)


@dataclass(frozen=True)
class Model:
    shape: Shape
    n_layers: int

    @property
    def cfg(self) -> ModelConfig:
        return self.shape.config(self.n_layers)

    @property
    def params(self) -> int:
        c = counts(self.shape)
        return c.outside + self.n_layers * c.block

    @property
    def gathered(self) -> int:
        """Parameters FSDP holds gathered at once: the root group and PREFETCH blocks."""
        c = counts(self.shape)
        return c.outside + min(PREFETCH, self.n_layers) * c.block

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token, as the trainer's MFU counts them."""
        return flops_per_token(self.cfg, self.params - counts(self.shape).embeddings)[0]

    @property
    def activations(self) -> float:
        tokens = MICRO_BATCH * SEQ_LEN
        return tokens * (
            self.n_layers * self.shape.d_model * RESIDUAL + BLOCK_ACTS * self.shape.d_model + LOGITS * VOCAB
        )


@dataclass(frozen=True)
class Island:
    """A region as its production profile describes it."""

    region: str
    nodes: int
    gpus_per_node: int
    gpu: str
    xr: CrossRegion
    async_save: bool  # its train config's checkpoint.async_save

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def hbm(self) -> float:
        return HBM[self.gpu][0]

    @property
    def host(self) -> float:
        return HOST[self.gpu][0]


def islands(sites_dir: Path = REPO / "sites") -> list[Island]:
    out = []
    for name in SITES:
        p = load_site(sites_dir, name).profile
        if not isinstance(p, SlurmProfile) or p.slurm.gpu_type is None or p.trainer.config is None:
            raise ValueError(f"site {name}: a Slurm profile with slurm.gpu_type and trainer.config is needed")
        cfg = load_config(REPO / p.trainer.config)
        gpu = p.slurm.gpu_type
        out.append(
            Island(name, p.node_count(), p.gpus_per_node(), gpu, p.cross_region, cfg.checkpoint.async_save)
        )
    return out


def leader_bytes_per_param(xr: CrossRegion) -> int:
    """Bytes of flat fp32 buffers a leader holds per parameter: the ``state_bytes()`` of the sync class
    ``modes.create`` builds for ``xr.sync`` and ``xr.overlap``, asked for one parameter."""
    from sbatch_gen.train.xr.diloco import DiLoCo
    from sbatch_gen.train.xr.grad import GradSync
    from sbatch_gen.train.xr.streaming import StreamingDiLoCo

    cls = GradSync if xr.sync == "grad" else StreamingDiLoCo if xr.overlap == "streaming" else DiLoCo
    probe = object.__new__(cls)
    probe.xr, probe.numel, probe.local_numel = xr, 1, 1
    return probe.state_bytes()


@dataclass(frozen=True)
class Rank:
    """One kind of rank of an island: its bytes by item, in HBM and in host memory."""

    label: str
    per_node: int  # ranks of this kind on the island's fullest node
    hbm: dict[str, float]
    host: dict[str, float]


def _outer(xr: CrossRegion, mode: str, n: int, w: int, movers: int, hbm: dict, host: dict) -> None:
    """The cross-region items of a rank that holds outer state (1/``w`` of it): the buffers, and in host
    memory the transfer buffers: the wire-dtype staging of what it uploads, and its share (1/``movers``)
    of the other regions' payloads and of an outer snapshot's copy."""
    held = leader_bytes_per_param(xr) * n / w
    on = host if mode == "fsdp+offload" else hbm
    if on is hbm and outer_placement(xr, torch.device("cuda"), math.ceil(held))[0].type == "cpu":
        on = host
    on["outer state"] = held
    # fp32 payloads need no staging when the state is in host memory already
    staging = (
        0 if xr.payload_dtype == "fp32" and on is host else wire_nbytes(xr.payload_dtype, math.ceil(n / w))
    )
    others = (len(xr.regions) - 1) * wire_nbytes(xr.payload_dtype, math.ceil(n / movers))
    host["transfer buffers"] = staging + others + (OUTER_SAVED * n / movers if xr.sync == "diloco" else 0)


def _rank(isl: Island, mode: str, m: Model, kind: tuple[str, int, bool], async_save: bool) -> Rank:
    """``kind``: the rank's label, how many such ranks a node has, and whether it holds outer state."""
    label, per_node, outer = kind
    n, xr = m.params, isl.xr
    w = 1 if mode == "ddp" else isl.ranks
    hbm: dict[str, float] = {}
    host: dict[str, float] = {}
    if mode == "ddp":
        hbm.update({k: b * n for k, b in DDP_ITEMS.items()})
    else:
        offload = mode == "fsdp+offload"
        (host if offload else hbm).update({k: b * n / w for k, b in FSDP_ITEMS.items()})
        hbm["gathered groups"] = m.gathered * (GATHERED + (OFFLOAD_COPIES / w if offload else 0))
    hbm["activations"] = m.activations
    if outer:
        movers = (isl.nodes if xr.node_leaders else 1) if mode == "ddp" else isl.ranks
        _outer(xr, mode, n, w, movers, hbm, host)
    if async_save:
        host["checkpoint staging"] = (SAVED + (OUTER_SAVED if outer and xr.sync == "diloco" else 0)) * n / w
    return Rank(label, per_node, hbm, host)


def ranks(isl: Island, mode: str, m: Model, async_save: bool | None = None) -> list[Rank]:
    """The island's kinds of rank in ``mode``: with DDP a node leader (local rank 0: the outer state) and
    the others; with FSDP every rank alike."""
    save = isl.async_save if async_save is None else async_save
    g, r, xr = isl.gpus_per_node, isl.region, isl.xr.enabled
    if mode != "ddp":
        kinds = [(f"{r} every rank", g, xr)]
    else:
        kinds = [(f"{r} local rank 0" if g > 1 else f"{r} rank 0", 1, xr)]
        kinds += [(f"{r} local rank 1-{g - 1}", g - 1, False)] if g > 1 else []
    return [_rank(isl, mode, m, k, save) for k in kinds]


def over(isl: Island, rs: list[Rank]) -> list[str]:
    """What ``rs`` exceed: "HBM" (a GPU's), "host" (the node's, every rank of it together), each less its
    reserve; [] if they fit."""
    out = []
    if any(sum(r.hbm.values()) > isl.hbm - HBM_RESERVE for r in rs):
        out.append("HBM")
    if sum(r.per_node * sum(r.host.values()) for r in rs) > isl.host - HOST_RESERVE:
        out.append("host")
    return out


@dataclass(frozen=True)
class Largest:
    model: Model
    bound: str  # what one block more exceeds ("HBM", "host", both) or "depth limit"


def largest(isl: Island, mode: str, shape: Shape, async_save: bool | None = None) -> Largest | None:
    """The deepest model of ``shape``'s width that fits (None if not even one block does). Every depth is
    tried, from the deepest the trainer allows: the outer state moves from HBM to host memory once it
    outgrows ``outer_device_max_gib``, so fitting is not monotonic in the depth."""
    for n_layers in range(MAX_LAYERS, 0, -1):
        m = Model(shape, n_layers)
        if not over(isl, ranks(isl, mode, m, async_save)):
            if n_layers == MAX_LAYERS:
                return Largest(m, "depth limit")
            deeper = ranks(isl, mode, Model(shape, n_layers + 1), async_save)
            return Largest(m, " and ".join(over(isl, deeper)))
    return None


def best(isl: Island, mode: str, async_save: bool | None = None) -> Largest | None:
    """The most parameters over the widths of SHAPES (memory follows the count; activations and FSDP's
    gathered groups also grow with the width)."""
    found = [x for x in (largest(isl, mode, s, async_save) for s in SHAPES) if x is not None]
    return max(found, key=lambda x: x.model.params, default=None)


# -- the result page -------------------------------------------------------------------------------------
LABELS = {"ddp": "DDP", "fsdp": "FSDP", "fsdp+offload": "FSDP+offload"}


def _gb(x: float) -> float:
    return round(x / GB, 2)


def _per_mode(isl: Island, m: Model) -> dict[str, list[Rank]]:
    return {mode: ranks(isl, mode, m) for mode in MODES}


def _positions(per: dict[str, list[Rank]]) -> list[tuple[str, dict[str, Rank]]]:
    """DDP's kinds of rank (a node leader, the others), each with the rank at that place in every mode
    (FSDP's ranks are all alike)."""
    return [
        (r.label, {mode: rs[min(j, len(rs) - 1)] for mode, rs in per.items()})
        for j, r in enumerate(per["ddp"])
    ]


def _machines(isls: list[Island]) -> list[list]:
    return [
        [
            f"{i.region} ({i.nodes} x {i.gpus_per_node} {i.gpu})",
            i.ranks,
            _gb(i.hbm),
            _gb(i.hbm - HBM_RESERVE),
            HBM[i.gpu][1],
            _gb(i.host),
            _gb(i.host - HOST_RESERVE),
            HOST[i.gpu][1],
        ]
        for i in isls
    ]


def _bytes_per_param(xr: CrossRegion) -> list[list]:
    ddp, fsdp = sum(DDP_ITEMS.values()), sum(FSDP_ITEMS.values())
    outer = leader_bytes_per_param(xr)
    wire = wire_nbytes(xr.payload_dtype, 1 << 20) / (1 << 20)
    rows = [
        [
            k,
            f"{b} HBM",
            f"{FSDP_ITEMS[k]}/W HBM" if k in FSDP_ITEMS else "-",
            f"{FSDP_ITEMS[k]}/W host" if k in FSDP_ITEMS else "-",
        ]
        for k, b in DDP_ITEMS.items()
    ]
    rows += [
        ["training state, total", f"{ddp} HBM", f"{fsdp}/W HBM", f"{fsdp}/W host"],
        [
            f"gathered groups (per parameter of the root group and {PREFETCH} blocks)",
            "-",
            f"{GATHERED} HBM",
            f"{GATHERED} + {OFFLOAD_COPIES}/W HBM",
        ],
        [
            f"outer state ({xr.sync}, overlap {xr.overlap})",
            f"{outer} on a node leader, 0 on the others; HBM up to outer_device_max_gib "
            f"{xr.outer_device_max_gib:g} GiB, else host",
            f"{outer}/W, the same rule per rank",
            f"{outer}/W host",
        ],
        [
            f"transfer buffers ({xr.payload_dtype} payloads, R regions)",
            f"{wire:g} staging + {wire:g} x (R-1) / leaders + {OUTER_SAVED} / leaders (snapshot copy), host",
            f"({wire:g} + {wire:g} x (R-1) + {OUTER_SAVED}) / W host",
            f"({wire:g} + {wire:g} x (R-1) + {OUTER_SAVED}) / W host",
        ],
        [
            "checkpoint staging (checkpoint.async_save)",
            f"{SAVED} (+{OUTER_SAVED} on a leader) host",
            f"{SAVED + OUTER_SAVED}/W host",
            f"{SAVED + OUTER_SAVED}/W host",
        ],
    ]
    return rows


def _shapes() -> list[list]:
    rows = []
    for s in SHAPES:
        m, c = Model(s, s.n_layers), counts(s)
        rows.append(
            [
                s.name,
                s.like,
                s.n_layers,
                s.d_model,
                s.n_heads,
                round(m.params / 1e9, 3),
                round(c.outside / 1e6, 1),
                round(c.block / 1e6, 1),
                round(m.flops_per_token / 1e9, 2),
                _gb(m.activations),
            ]
        )
    return rows


def _over_text(isl: Island, per: dict[str, list[Rank]]) -> str:
    parts = [f"{LABELS[mode]}: {' and '.join(o)}" for mode, rs in per.items() if (o := over(isl, rs))]
    return "; ".join(parts) or "-"


def _per_rank(isls: list[Island]) -> tuple[list[list], list[list]]:
    """Totals per rank (a row per kind of rank DDP has; FSDP's ranks are all alike) and per node."""
    rows, nodes = [], []
    for s in SHAPES:
        m = Model(s, s.n_layers)
        for isl in isls:
            per = _per_mode(isl, m)
            for label, at in _positions(per):
                cells: list = [s.name, label]
                for x in at.values():
                    cells += [_gb(sum(x.hbm.values())), _gb(sum(x.host.values()))]
                rows.append([*cells, _over_text(isl, per)])
            node = [_gb(sum(r.per_node * sum(r.host.values()) for r in per[mode])) for mode in MODES]
            nodes.append(
                [
                    s.name,
                    f"{isl.region} ({isl.gpus_per_node} rank{'s' if isl.gpus_per_node > 1 else ''})",
                    *node,
                    _gb(isl.host - HOST_RESERVE),
                ]
            )
    return rows, nodes


def _breakdown(isls: list[Island]) -> list[list]:
    rows = []
    for s in SHAPES:
        m = Model(s, s.n_layers)
        for isl in isls:
            for label, at in _positions(_per_mode(isl, m)):
                items = list(dict.fromkeys(k for x in at.values() for k in (*x.hbm, *x.host)))
                for item in items:
                    cells = []
                    for x in at.values():
                        where = "HBM" if item in x.hbm else "host" if item in x.host else None
                        b = x.hbm.get(item, x.host.get(item))
                        cells.append(f"{fmt(_gb(b))} {where}" if where else "-")
                    rows.append([s.name, label, item, *cells])
    return rows


def _largest(isls: list[Island]) -> tuple[list[list], dict[str, dict[str, Largest | None]]]:
    rows, found = [], {}
    for isl in isls:
        for mode in MODES:
            cells = []
            for s in SHAPES:
                x = largest(isl, mode, s)
                cells.append(
                    "none fits"
                    if x is None
                    else f"{x.model.params / 1e9:.2f}B ({x.model.n_layers} blocks; {x.bound})"
                )
            top, no_stage = best(isl, mode), best(isl, mode, async_save=False)
            found.setdefault(mode, {})[isl.region] = top
            rows.append([isl.region, LABELS[mode], *cells, _billions(top), _billions(no_stage)])
    return rows, found


def _billions(x: Largest | None) -> str:
    return "none" if x is None else f"{x.model.params / 1e9:.2f}B (d_model {x.model.shape.d_model})"


def _run_rows(found: dict[str, dict[str, Largest | None]]) -> list[list]:
    rows = []
    for mode, by in found.items():
        sizes = {r: (x.model.params if x is not None else 0) for r, x in by.items()}
        binding = min(sizes, key=lambda r: sizes[r])
        x = by[binding]
        rows.append(
            [
                LABELS[mode],
                f"{sizes[binding] / 1e9:.2f}B",
                binding,
                x.bound if x else "-",
                ", ".join(f"{r} {v / 1e9:.2f}B" for r, v in sizes.items() if r != binding),
            ]
        )
    return rows


def _setup(isls: list[Island]) -> list[str]:
    xr = isls[0].xr
    eu = isls[0]
    return [
        "The computation: bench/memory.py. GB = 10^9 bytes.",
        f"Islands from the production profiles sites/{'.yaml, sites/'.join(SITES)}.yaml: nodes, GPUs and "
        f"slurm.gpu_type; their cross_region (sync {xr.sync}, overlap {xr.overlap}, payload_dtype "
        f"{xr.payload_dtype}, {len(xr.regions)} regions, outer_device {xr.outer_device}, outer_device_max_gib "
        f"{xr.outer_device_max_gib:g}, node_leaders {xr.node_leaders}); checkpoint.async_save {eu.async_save} "
        "from their train config (async saves keep a host copy of what the rank saves for the whole run).",
        "Model: the trainer's GPT (sbatch_gen/train/model.py: learned positions, LayerNorm, 4x GELU MLP: 12 "
        f"d_model^2 parameters per block, like the SwiGLU blocks of the open models named), vocabulary {VOCAB} "
        f"(the Llama tokenizer's), untied embeddings, seq_len {SEQ_LEN}, activation checkpointing on. Parameter "
        "counts come from the model built on the meta device, FLOPs per token from the trainer's MFU function.",
        f"Activations per rank: {MICRO_BATCH} sequence of {SEQ_LEN} tokens per micro-batch; each block's input "
        f"kept for the recompute ({RESIDUAL} B per element: the residual stream is fp32 under autocast), one "
        f"block's activations while it is recomputed ({BLOCK_ACTS} B per token and unit of d_model: Korthikanti "
        "et al. 2022, bf16, without the attention-score term fused attention never stores), the logits "
        f"({LOGITS} B per token and vocabulary entry: bf16 logits, the loss's fp32 copy, the log-softmax kept "
        "for backward, their gradient). They grow linearly with the micro-batch.",
        "DDP: every rank a full replica (fp32 master, autocast's bf16 copies, fp32 gradients in DDP's buckets, "
        "AdamW fp32 m and v); the outer state on each node's leader (local rank 0), the other ranks hold none.",
        "FSDP: fully_shard per block and the root over the region's W ranks (eu W = "
        f"{eu.ranks}, us W = {isls[-1].ranks}), bf16 parameters gathered, fp32 reduce-scatter; each rank holds "
        "1/W of the parameters, gradients, AdamW and outer state. The outer state per rank is issue 30 item "
        "2's design (each rank its own shards, the same outer_device rule per rank), not built yet.",
        "FSDP+offload: CPUOffloadPolicy: the shards, gradients and AdamW in host memory, and the outer state "
        "with them; HBM holds the gathered groups (with the shards copied in and out) and the activations.",
        f"Reserves, flat estimates for what the table leaves out: {HBM_RESERVE / GB:g} GB per GPU (CUDA "
        "context, NCCL buffers, allocator fragmentation), "
        f"{HOST_RESERVE / GB:g} GB per node (OS, data loaders, the processes' own memory).",
        "Fits: every rank's HBM items within its GPU's HBM less the reserve, and the node's ranks' host items "
        "together within the node's host memory less its reserve ('usable' below).",
        f"Largest model: per width of the shapes, the deepest model (1 to {MAX_LAYERS} blocks, the trainer's "
        "limit) that fits; 'bound' names what one block more exceeds. Every region trains the same model, "
        "so the run's largest model is its smallest island's: that island binds.",
    ]


NOTES = [
    "Left out beyond the reserves: the caching allocator's fragmentation above the reserve, temporaries of "
    "the optimizer step, of gradient clipping and of the loss, DDP's and FSDP's communication buffers, "
    "pinned batches of the data loader.",
    "The GH200 can also run over its HBM into Grace memory (unified memory over NVLink-C2C); not modelled: "
    "HBM is a hard limit here.",
    "The checkpoint staging is a real share of host memory: with async_save off the host-bound limits move "
    "(the last column of the largest-model table).",
    "The outer state follows outer_device auto: above outer_device_max_gib per rank it goes to host "
    "memory, where it competes with the checkpoint staging; a larger outer_device_max_gib keeps it in HBM "
    "instead, trading one for the other (not tabulated).",
    "To be replaced by measurements where a GPU is at hand: issue 30 item 5's GPU check (memory per phase "
    "with FSDP, offload on and off).",
]


def compute(quick: bool = False) -> Result:
    """The whole page (no files written): the same figures on every machine."""
    res = Result(
        "memory",
        "Memory per rank: DDP vs FSDP vs FSDP+offload on the production islands (analytic)",
        quick,
        analytic=True,
    )
    isls = islands()
    res.setup += _setup(isls)
    res.table(
        "Machines",
        [
            "island",
            "ranks",
            "HBM per GPU, GB",
            "usable",
            "HBM source",
            "host per node, GB",
            "usable",
            "host source",
        ],
        _machines(isls),
        "machines",
    )
    res.table(
        "Bytes per parameter of the model, per rank (W: the region's ranks; R: the regions)",
        ["item", "DDP", "FSDP", "FSDP+offload"],
        _bytes_per_param(isls[0].xr),
        "bytes_per_param",
    )
    res.table(
        "Model shapes",
        [
            "model",
            "like",
            "blocks",
            "d_model",
            "heads",
            "parameters, B",
            "outside the blocks, M",
            "per block, M",
            "model GFLOP/token",
            "activations per rank, GB",
        ],
        _shapes(),
        "shapes",
    )
    rows, nodes = _per_rank(isls)
    res.table(
        "Per rank, GB (HBM / host)",
        [
            "model",
            "rank",
            "DDP HBM",
            "DDP host",
            "FSDP HBM",
            "FSDP host",
            "FSDP+offload HBM",
            "FSDP+offload host",
            "over capacity",
        ],
        rows,
        "per_rank",
    )
    res.table(
        "Host memory per node, GB (every rank of the node)",
        ["model", "node", "DDP", "FSDP", "FSDP+offload", "usable"],
        nodes,
        "per_node",
    )
    largest_rows, found = _largest(isls)
    res.table(
        "Largest model each island can train",
        [
            "island",
            "mode",
            *(f"d_model {s.d_model}" for s in SHAPES),
            "largest",
            "largest without async_save staging",
        ],
        largest_rows,
        "largest",
    )
    run_rows = _run_rows(found)
    res.table(
        "Largest model the run can train, and the binding island",
        ["mode", "largest model", "binding island", "bound by", "other islands"],
        run_rows,
        "run",
    )
    res.table(
        "Breakdown per rank, GB",
        ["model", "rank", "item", "DDP", "FSDP", "FSDP+offload"],
        _breakdown(isls),
        "breakdown",
    )
    for mode, size, island, bound, others in run_rows:
        res.headline[f"largest model, {mode} (analytic)"] = f"{size}, bound by {island} ({bound}); {others}"
    res.notes += NOTES
    return res


def run(out_dir: Path, quick: bool = False) -> Result:
    """``python -m bench memory``: instant, and the same with ``--quick``."""
    return compute(quick)
