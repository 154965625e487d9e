"""A torchtitan-style FSDP2 training script on sbatch-gen's public library (sbatch_gen.train.api): the model
sharded with fully_shard on each block and on the root, DiLoCo across regions on each rank's own shards,
sharded checkpoints through torch.distributed.checkpoint (DCP), and the stop/requeue hand-off of the
rendered Slurm jobs.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --run-dir runs/fsdp --data README.md

It takes the same --xr-* flags as examples/train_plain.py (the DDP version of this script; a profile launches
either the same way). The model is a toy (the next byte from the previous --context bytes, through a stack
of residual MLP blocks); what surrounds it is what a sharded trainer needs. Each rank holds 1/N of the
parameters, of AdamW's state and of DiLoCo's outer state, and moves only its own shards through the
mailbox. A checkpoint (ckpt/step-N/, a DCP directory; ckpt/latest names the newest complete one) resumes at
any world size: DCP reshards the model, the optimizer and the outer state alike. Exit codes: 0 done (or,
with a stop file, checkpointed: the .ack says so), 42 checkpointed and asking for a requeue without a stop
file, 2 bad arguments, 1 a failure.
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

parser = argparse.ArgumentParser(prog="train_fsdp.py", description=__doc__.splitlines()[0])
try:
    xr, rest = cross_region_from_args()  # the --xr-* flags ({xr_args} in the profile); rest: our own flags
except CrossRegionError as e:
    parser.exit(2, f"train_fsdp.py: {e}\n")  # one line per bad flag, no traceback
parser.add_argument("--run-dir", type=Path, required=True, help="checkpoints (ckpt/) and final.pt")
parser.add_argument("--data", type=Path, required=True, help="a file or directory: its bytes are the data")
parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
parser.add_argument("--context", type=int, default=16, help="bytes the model sees")
parser.add_argument("--blocks", type=int, default=2, help="residual blocks, each sharded on its own")
args = parser.parse_args(rest)
files = sorted(p for p in args.data.rglob("*") if p.is_file()) if args.data.is_dir() else [args.data]
try:
    raw = bytearray(b"".join(p.read_bytes() for p in files))
except OSError as e:
    parser.exit(2, f"train_fsdp.py: --data: cannot read {e.filename}: {e.strerror}\n")
if len(raw) <= args.context + 1:
    parser.exit(2, f"train_fsdp.py: --data {args.data}: {len(raw)} bytes, too few for the context\n")

import torch  # noqa: E402 - importing torch takes seconds: after the stop handler
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


class Block(nn.Module):
    """x + MLP(LayerNorm(x)): one unit of sharding, gathered for its forward and its backward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ByteNet(nn.Module):
    """Embeds the last `context` bytes, runs them through `blocks` residual blocks, predicts the next byte."""

    def __init__(self, context: int, blocks: int, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.proj = nn.Linear(context * dim, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(x).flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


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
        print(f"train_fsdp.py: {message}", flush=True)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows drawn from (seed, region, rank, step) alone: a resumed run sees the batches it would have."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}/{xr.region}/{rank}/{step}".encode()))
    starts = torch.randint(0, len(data) - args.context, (args.batch_size,), generator=g)
    windows = data[starts[:, None] + torch.arange(args.context + 1)]
    return windows[:, :-1].to(device), windows[:, -1].to(device)


def state(step: int) -> dict:
    """What a checkpoint holds, as DCP saves it and as the template a load fills in: this rank's shards of
    the model and of AdamW's state, DiLoCo's outer state for those shards (DTensors placed like the
    parameters), and the step."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "outer": diloco.state_dict() if diloco else {},
        "step": step,
    }


def save(step: int) -> Path:
    """Every rank writes its own shards into ckpt/step-N/ (DCP, collective), then rank 0 points ckpt/latest
    at it; every rank returns once both exist."""
    path = ckpt_dir / f"step-{step}"
    dcp.save(state(step), checkpoint_id=str(path))  # returns on every rank once the metadata is written
    if rank == 0:
        tmp = path.parent / ".latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, ckpt_dir / "latest")  # only ever names a complete checkpoint
        say(f"saved {path}")
    dist.barrier()
    return path


def load() -> int:
    """Every rank loads its shards of the newest complete checkpoint (resharded by DCP when the region
    runs at another world size than it saved with); returns its step."""
    path = ckpt_dir / (ckpt_dir / "latest").read_text()
    loaded = state(0)
    dcp.load(loaded, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    if diloco:
        diloco.load_state_dict(loaded["outer"])  # after DiLoCo is built, before start()
    say(f"resumed from {path}")
    return int(loaded["step"])


def final_weights() -> None:
    """The whole model, gathered (collective), into rank 0's final.pt: one file, for any world size."""
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        tmp = args.run_dir / ".final.pt.tmp"
        torch.save(whole, tmp)
        os.replace(tmp, args.run_dir / "final.pt")


# Build, then shard torchtitan's way: each block its own FSDP unit (gathered for its forward and again for
# its backward), then the root (embedding, projection, head), over a 1-D mesh of the whole region. The same
# seed on every rank: the ranks start from one model, each keeping its rows of it.
torch.manual_seed(args.seed)
model = ByteNet(args.context, args.blocks).to(device)
mesh = init_device_mesh(device.type, (world,))
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # on the sharded parameters: 1/N of its state
tokens = args.batch_size * world  # what the whole region consumes per step: one predicted byte per sample
diloco: DiLoCo | None = None
code, step = 0, 0
try:
    if xr.enabled:  # after fully_shard, before the first forward; collective: every rank of the region
        diloco = DiLoCo(model, xr, run_dir=args.run_dir, device=device)
    if (ckpt_dir / "latest").exists():
        step = load()
    if diloco:
        step = diloco.start(step)  # a fresh run adopts the first region's weights; a late one catches up
    say(f"region {xr.region}, {world} processes (FSDP), steps {step + 1}..{args.steps}")
    while step < args.steps:
        step += 1
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)  # FSDP gathers each block, then reduce-scatters its gradients
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if diloco:  # sync: grad averages the gradients over the regions here (DiLoCo: nothing to do)
            diloco.before_optimizer_step(step, tokens)
        opt.step()
        if diloco:  # every xr.inner_steps steps: an outer round with the other regions, on the local shards
            record = diloco.after_step(step, tokens)
            if record and "xr_adopted_step" in record:  # this region was behind: it now holds the run's step
                step = min(record["xr_adopted_step"], args.steps)
        if step % 10 == 0:
            say(f"step {step} loss {loss.item():.4f}")
        if stop.agree():  # one all-reduce: every rank stops after the same step
            last = (step - 1) // args.save_every * args.save_every  # the newest periodic save before it
            say(stop.saving(step, last or None))  # what is redone if the save is cut short
            path = save(step)
            if diloco:
                diloco.leave(step, stop.reason())  # elastic runs: the other regions stop waiting for us
            stop.acknowledge(step, path)  # every rank saved: each node writes <stop file>.ack
            code = stop.exit_code()  # 0 under a launcher (it reads the ack: no torchrun traceback), else 42
            say(f"stop requested ({stop.reason()}): checkpointed at step {step}, exiting {code}")
            break
        if step % args.save_every == 0 or step == args.steps:
            save(step)
    else:  # no stop: the end
        if diloco:
            diloco.finish(step)
            diloco.leave(step, "finished")
        final_weights()
        say(f"done at step {step}{f' after {diloco.round} outer rounds' if diloco else ''}: wrote final.pt")
except XRTimeout as e:  # XRNoQuorum too: every rank raises it alike; not enough regions now
    saved_at = save(step) if step else None
    if diloco:
        diloco.leave(step, "no quorum")
    stop.acknowledge(step, saved_at, reason="no cross-region quorum")  # the job requeues on the .ack
    code = stop.exit_code()
    saved = f"checkpointed at step {step}" if saved_at else "nothing to checkpoint yet"
    say(f"no cross-region quorum ({e}); {saved}, exiting {code}")
except XRError as e:  # a broken mailbox, a layout mismatch between regions, ...
    say(f"cross-region sync failed: {type(e).__name__}: {e}")
    code = 1
finally:
    if diloco:
        diloco.close()
    dist.destroy_process_group()
exit_process(code)  # sys.exit without the interpreter teardown that can abort gloo (SIGABRT)
