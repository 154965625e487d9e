"""A plain PyTorch training script on sbatch-gen's public library (sbatch_gen.train.api): DDP inside a region,
DiLoCo across regions, checkpoints of its own, and the stop/requeue hand-off of the rendered Slurm jobs.

    torchrun --standalone --nproc-per-node 2 examples/train_plain.py --run-dir runs/plain --data README.md

examples/sites/plain.yaml launches it on a Slurm cluster, adding the --xr-* flags and the stop file. The model
is a toy (the next byte from the previous --context bytes); what surrounds it is what a real trainer needs.
Exit codes: 0 done (or, with a stop file, checkpointed: the .ack says so), 42 checkpointed and asking for a
requeue without a stop file, 2 bad arguments, 1 a failure.
"""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path

from sbatch_gen.train.api import (
    CrossRegionError,
    DiLoCo,
    StopRequest,
    XRError,
    XRTimeout,
    cross_region_from_args,
    exit_process,
)

# First, before the slow imports: a stop that arrives while we start up is a request, not a crash.
stop = StopRequest.from_env()  # the stop file the rendered job names in $SBATCH_GEN_STOP_FILE
stop.exit_if_acked()  # this attempt has checkpointed already (torchrun restarted us): do not train again
stop.install()  # SIGUSR1/SIGTERM now only set a flag, which the loop reads once per step

parser = argparse.ArgumentParser(prog="train_plain.py", description=__doc__.splitlines()[0])
try:
    xr, rest = cross_region_from_args()  # the --xr-* flags ({xr_args} in the profile); rest: our own flags
except CrossRegionError as e:
    parser.exit(2, f"train_plain.py: {e}\n")  # one line per bad flag, no traceback
parser.add_argument("--run-dir", type=Path, required=True, help="checkpoints (ckpt/) and final.pt")
parser.add_argument("--data", type=Path, required=True, help="a file or directory: its bytes are the data")
parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
parser.add_argument("--context", type=int, default=16, help="bytes the model sees")
args = parser.parse_args(rest)
files = sorted(p for p in args.data.rglob("*") if p.is_file()) if args.data.is_dir() else [args.data]
try:
    raw = bytearray(b"".join(p.read_bytes() for p in files))
except OSError as e:
    parser.exit(2, f"train_plain.py: --data: cannot read {e.filename}: {e.strerror}\n")
if len(raw) <= args.context + 1:
    parser.exit(2, f"train_plain.py: --data {args.data}: {len(raw)} bytes, too few for the context\n")

import torch  # noqa: E402 - importing torch takes seconds: after the stop handler
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


class ByteMLP(nn.Module):
    """Embeds the last `context` bytes and predicts the next one."""

    def __init__(self, context: int, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.mlp = nn.Sequential(nn.Linear(context * dim, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x).flatten(1))


def write_atomic(path: Path, obj: object) -> None:
    """A str as text, anything else with torch.save, to a temporary file; fsync; rename: a reader (or a
    crash) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        if isinstance(obj, str):
            f.write(obj.encode())
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)  # and the rename itself on disk
    os.fsync(fd)
    os.close(fd)


# One process group per region, from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).
cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = torch.frombuffer(raw, dtype=torch.uint8).long()
ckpt_dir = args.run_dir / "ckpt"


def say(message: str) -> None:
    if rank == 0:
        print(f"train_plain.py: {message}", flush=True)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows drawn from (seed, region, rank, step) alone: a resumed run sees the batches it would have."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}/{xr.region}/{rank}/{step}".encode()))
    starts = torch.randint(0, len(data) - args.context, (args.batch_size,), generator=g)
    windows = data[starts[:, None] + torch.arange(args.context + 1)]
    return windows[:, :-1].to(device), windows[:, -1].to(device)


def save(step: int) -> Path:
    """Rank 0 writes ckpt/step-N.pt, then points ckpt/latest at it; every rank returns once both exist."""
    path = ckpt_dir / f"step-{step}.pt"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        outer = diloco.state_dict() if diloco else None  # DiLoCo's outer state goes into our checkpoint
        write_atomic(path, {"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "xr": outer})
        write_atomic(ckpt_dir / "latest", path.name)  # only ever names a complete file
        say(f"saved {path}")
    dist.barrier()
    return path


torch.manual_seed(args.seed)
model = ByteMLP(args.context).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
step, ckpt = 0, None
if (ckpt_dir / "latest").exists():  # resume: every rank reads the newest complete checkpoint
    path = ckpt_dir / (ckpt_dir / "latest").read_text()
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    step = ckpt["step"]
    say(f"resumed from {path}")
ddp = DDP(model, device_ids=[device.index] if cuda else None)  # averages gradients over the region's ranks
tokens = args.batch_size * world  # what the whole region consumes per step: one predicted byte per sample
diloco: DiLoCo | None = None
code = 0
try:
    if xr.enabled:
        diloco = DiLoCo(model, xr, run_dir=args.run_dir)  # collective: every rank of the region
        if ckpt and ckpt["xr"] is not None:
            diloco.load_state_dict(ckpt["xr"])
        step = diloco.start(step)  # a fresh run adopts the first region's weights; a late one catches up
    say(f"region {xr.region}, {world} processes, steps {step + 1}..{args.steps}")
    while step < args.steps:
        step += 1
        x, y = batch(step)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if diloco:  # sync: grad averages the gradients over the regions here (DiLoCo: nothing to do)
            diloco.before_optimizer_step(step, tokens)
        opt.step()
        if diloco:  # every xr.inner_steps steps: an outer round with the other regions
            record = diloco.after_step(step, tokens)
            if record and "xr_adopted_step" in record:  # this region was behind: it now holds the run's step
                step = min(record["xr_adopted_step"], args.steps)
        if step % 10 == 0:
            say(f"step {step} loss {loss.item():.4f}")
        if stop.agree():  # one all-reduce: every rank stops after the same step
            # the newest periodic save before this step
            last = (step - 1) // args.save_every * args.save_every
            say(stop.saving(step, last or None))  # what is redone if the save is cut short
            path = save(step)
            if diloco:
                diloco.leave(step, stop.reason())  # elastic runs: the other regions stop waiting for us
            # save() has returned on every rank (the checkpoint is complete): each node writes <stop file>.ack
            stop.acknowledge(step, path)
            code = stop.exit_code()  # 0 under a launcher (it reads the ack: no torchrun traceback), else 42
            say(f"stop requested ({stop.reason()}): checkpointed at step {step}, exiting {code}")
            break
        if step % args.save_every == 0 or step == args.steps:
            save(step)
    else:  # no stop: the end
        if diloco:
            diloco.finish(step)  # overlap eager: the round still in flight, so all regions end alike
            diloco.leave(step, "finished")
        if rank == 0:
            write_atomic(args.run_dir / "final.pt", model.state_dict())
        say(f"done at step {step}{f' after {diloco.round} outer rounds' if diloco else ''}: wrote final.pt")
except XRTimeout as e:  # XRNoQuorum too: every rank raises it alike; not enough regions now
    path = save(step) if step else None
    if diloco:
        diloco.leave(step, "no quorum")
    stop.acknowledge(step, path, reason="no cross-region quorum")  # the job requeues on the .ack
    code = stop.exit_code()
    saved = f"checkpointed at step {step}" if path else "nothing to checkpoint yet"
    say(f"no cross-region quorum ({e}); {saved}, exiting {code}")
except XRError as e:  # a broken mailbox, a layout mismatch between regions, ...
    say(f"cross-region sync failed: {type(e).__name__}: {e}")
    code = 1
finally:
    if diloco:
        diloco.close()
    dist.destroy_process_group()
exit_process(code)  # sys.exit without the interpreter teardown that can abort gloo (SIGABRT)
