"""Diagnostic (issue 43): why sparse outer updates lose to dense bf16 DiLoCo at H=50 in bench sparse.

Not a benchmark of the trainer: one process emulates the two regions of bench sparse (the trainer's GPT,
AdamW with its two groups, lr schedule and clipping, each region's own shard and sampler, the inner
optimizer state kept across rounds, every region reset to theta_outer after each round) and applies an
outer rule per variant, so the parts of the sparse rule can be swapped one at a time:

- ``dense``: the token-weighted (here equal) mean of the deltas, outer lr, no momentum;
- ``sparse``: the trainer's rule (docs/cross-region.md): p = delta + beta e, q = decode(encode(p)) with the
  trainer's codec (:mod:`sbatch_gen.train.xr.sparse`: chunk-wise top-k over the flat vector, 2 levels),
  e = p - q, theta -= lr mean(q);
- ``topk``: the same without the quantiser (the kept values exact): what the 2-level quantiser costs;
- ``pertensor``: the trainer's codec applied to each parameter tensor on its own (chunks restart at every
  tensor: for the width-64 matrices a chunk of 4096 is a 64 x 64 tile): what the flat layout costs;
- ``flush``: ``sparse``, but the last round sends p whole (dense, exact): how much of the gap is progress
  still waiting in the error buffers at the end, rather than a worse direction;
- ``densefirst``: ``sparse``, but the first ``DENSE_FIRST`` rounds send p whole: whether the early rounds,
  where the model moves most, are where sparse falls behind.

Per variant: held-out loss of the final outer model (the windows of bench quality); per round the
projection of the applied update on the round's mean delta, the error buffers' norm against the deltas',
the cosine of the mean delta with the previous round's and of the summed buffer with the mean delta; at the
end the share of parameters that ever moved from their initial value, per tensor kind.
``python -m bench.sparse_diag [steps] [variants]`` (default 2000 steps and the first six variants of
``main``'s plan; variants: indices into it, comma-separated); 20-55 s a variant on 2 shared cores.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sbatch_gen.train.config import ModelConfig, TrainConfig
from sbatch_gen.train.data import Sampler, prepare
from sbatch_gen.train.model import GPT
from sbatch_gen.train.optim import build_optimizer, lr_at
from sbatch_gen.train.xr import sparse

from .quality import FULL
from .regionruns import DATA_BYTES, HELDOUT, REGIONS

CHUNK = 4096
DENSE_FIRST = 4  # densefirst: this many rounds dense at the start


@dataclass(frozen=True)
class D:
    rule: str  # dense | sparse | topk | pertensor | flush | densefirst
    h: int
    density: float = 0.01
    lr: float = 1.0
    beta: float = 0.95

    @property
    def label(self) -> str:
        if self.rule == "dense":
            return f"H={self.h} dense, lr {self.lr:g}"
        return f"H={self.h} {self.rule} {self.density * 100:g}%, lr {self.lr:g}"


def _codec(x: torch.Tensor, k: int) -> torch.Tensor:
    return sparse.decode(sparse.encode(x, CHUNK, k), x.numel(), CHUNK, k).clone()


def _topk(x: torch.Tensor, k: int) -> torch.Tensor:
    n = x.numel()
    nc = -(-n // CHUNK)
    pad = torch.zeros(nc * CHUNK)
    pad[:n] = x
    rows = pad.view(nc, CHUNK)
    idx = rows.abs().topk(k, dim=1).indices
    out = torch.zeros_like(rows)
    out.scatter_(1, idx, rows.gather(1, idx))
    return out.reshape(-1)[:n]


def _compress(rule: str, p: torch.Tensor, k: int, sizes: list[int]) -> torch.Tensor:
    if rule in ("sparse", "flush", "densefirst"):
        return _codec(p, k)
    if rule == "topk":
        return _topk(p, k)
    if rule == "pertensor":
        return torch.cat([_codec(part, k) for part in p.split(sizes)])
    raise ValueError(rule)


def _heldout(model: GPT, tokens: np.ndarray, n_windows: int, seq: int) -> float:
    total = (tokens.size - 1) // seq
    offs = np.linspace(0, total - 1, n_windows).astype(np.int64) * seq
    model.eval()
    s = 0.0
    with torch.no_grad():
        for i in range(0, n_windows, 64):
            w = torch.from_numpy(
                np.stack([tokens[o : o + seq + 1] for o in offs[i : i + 64]]).astype(np.int64)
            )
            s += float(model(w[:, :-1], w[:, 1:])) * w.shape[0]
    model.train()
    return s / n_windows


def run_one(v: D, cfg: TrainConfig, data: Path, eval_windows: int) -> dict:
    torch.manual_seed(cfg.train.seed)
    mc = cfg.model
    models = [GPT(mc) for _ in REGIONS]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, cfg, torch.device("cpu")) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    sizes = [p.numel() for p in models[0].parameters()]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    theta = flat(models[0]).clone()
    init = theta.clone()
    err = [torch.zeros_like(theta) for _ in REGIONS]
    k = sparse.kept(CHUNK, v.density)
    tokens = [np.fromfile(data / f"{r}.bin", dtype=np.uint8) for r in REGIONS]
    samplers = [Sampler(len(t), mc.seq_len, cfg.train.batch_size, 0, 1, cfg.train.seed) for t in tokens]
    rounds: list[dict] = []
    prev: torch.Tensor | None = None  # the previous round's mean delta
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm() + 1e-30))  # noqa: E731
    for step in range(1, cfg.train.steps + 1):
        lr = lr_at(cfg, step)
        for m, o, s, t in zip(models, opts, samplers, tokens, strict=True):
            for g in o.param_groups:
                g["lr"] = lr
            x, y = s.batch(t)
            loss = m(torch.from_numpy(x), torch.from_numpy(y))
            o.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.optim.grad_clip)
            o.step()
        if step % v.h and step != cfg.train.steps:
            continue
        deltas = [theta - flat(m) for m in models]
        mean_delta = sum(deltas) / len(deltas)
        # how alike the rounds' deltas are (the model moved little: the same delta again), and how the error
        # buffer (before this round's delta) points against the fresh delta
        repeat = cos(mean_delta, prev) if prev is not None else float("nan")
        e_vs_delta = cos(sum(err), mean_delta) if any(bool(e.any()) for e in err) else float("nan")
        prev = mean_delta
        if v.rule == "dense":
            g = mean_delta
            sent = 1.0
        else:
            qs = []
            for i, d in enumerate(deltas):
                p = d + v.beta * err[i]
                last = step == cfg.train.steps
                whole = (v.rule == "flush" and last) or (v.rule == "densefirst" and len(rounds) < DENSE_FIRST)
                q = p.clone() if whole else _compress(v.rule, p, k, sizes)
                err[i] = p - q
                qs.append(q)
            g = sum(qs) / len(qs)
            # how much of this round's mean delta the applied update holds, by projection
            sent = float(g @ mean_delta / (mean_delta @ mean_delta))
        theta -= v.lr * g
        rounds.append(
            {
                "step": step,
                "delta_norm": float(mean_delta.norm()),
                "applied_norm": float(g.norm()),
                "projection": sent,
                "err_over_delta": float(sum(e.norm() for e in err) / sum(d.norm() for d in deltas)),
                "repeat": repeat,
                "e_vs_delta": e_vs_delta,
            }
        )
        for m in models:  # every region adopts theta_outer
            off = 0
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(theta[off : off + p.numel()].view_as(p))
                    off += p.numel()
    moved = (theta != init).float()
    kinds: dict[str, list[float]] = {}
    off = 0
    for n, size in zip(names, sizes, strict=True):
        kind = "norm/bias" if "ln" in n or n.endswith("bias") else n.split(".")[-2] if "." in n else n
        kinds.setdefault(kind, [0.0, 0.0])
        kinds[kind][0] += float(moved[off : off + size].sum())
        kinds[kind][1] += size
        off += size
    held = _heldout(models[0], np.fromfile(data / f"{HELDOUT}.bin", dtype=np.uint8), eval_windows, mc.seq_len)
    return {
        "label": v.label,
        "heldout": held,
        "moved": float(moved.mean()),
        "moved_by_kind": {kk: a / b for kk, (a, b) in kinds.items()},
        "rounds": rounds,
    }


def _med(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else float("nan")


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv else FULL.steps
    torch.set_num_threads(1)
    sz = FULL
    plan = [
        D("dense", 50),
        D("sparse", 50, lr=2.0),
        D("topk", 50, lr=2.0),
        D("pertensor", 50, lr=2.0),
        D("sparse", 10, lr=2.0),
        D("sparse", 50, density=0.03, lr=2.0),
        D("flush", 50, lr=2.0),
        D("sparse", 50, density=0.05, lr=2.0),  # the bytes per step of H=10 at 1%
        D("sparse", 100, density=0.1, lr=2.0),  # ... and of H=100
        D("densefirst", 50, lr=2.0),
        D("densefirst", 50, lr=1.0),
        D("sparse", 100, lr=4.0),  # past bench sparse's grid edge at H=100 (lr 2 was its best)
        D("sparse", 100, density=0.03, lr=4.0),
    ]
    if len(argv) > 1:
        plan = [plan[int(i)] for i in argv[1].split(",")]
    with tempfile.TemporaryDirectory(prefix="sbgen-sparse-diag-", dir="/dev/shm") as tmp:
        data = Path(tmp)
        prepare(data, [*REGIONS, HELDOUT], "python-stdlib", DATA_BYTES)
        cfg = TrainConfig.model_validate(
            {
                "model": {**sz.model, "dropout": 0.0},
                "data": {"path": str(data), "source": "python-stdlib", "max_bytes": DATA_BYTES},
                "train": {"steps": steps, "batch_size": sz.batch, "seed": sz.seed},
                "optim": {"lr": sz.lr, "min_lr": sz.lr / 10, "warmup_steps": sz.warmup},
                "run_dir": str(data / "run"),
            }
        )
        assert isinstance(cfg.model, ModelConfig)
        for v in plan:
            t0 = time.monotonic()
            r = run_one(v, cfg, data, sz.eval_windows)
            rs = r["rounds"]
            proj = [x["projection"] for x in rs]
            print(
                f"{r['label']}: held-out {r['heldout']:.4f}; moved from init {r['moved']:.1%} "
                f"({', '.join(f'{kk} {x:.0%}' for kk, x in r['moved_by_kind'].items())}); rounds {len(rs)}; "
                f"projection of the mean delta applied: first {proj[0]:.3f}, median {sorted(proj)[len(proj) // 2]:.3f}, "
                f"last {proj[-1]:.3f}; |e|/|delta| last {rs[-1]['err_over_delta']:.2f}; "
                f"cos(delta, previous delta) median {_med([x['repeat'] for x in rs[1:]]):.2f}; "
                f"cos(e, delta) median {_med([x['e_vs_delta'] for x in rs[1:]]):.2f}; "
                f"|applied|/|delta| median "
                f"{sorted(x['applied_norm'] / x['delta_norm'] for x in rs)[len(rs) // 2]:.3f} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
