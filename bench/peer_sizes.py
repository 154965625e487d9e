"""``bench peer``: one run's variant (:class:`V`), the run sizes (full and ``--quick``) and the settings
both sides share."""

from __future__ import annotations

from dataclasses import dataclass, replace

TIMEOUT = 900  # seconds one run may take
SYSTEMS = ("torchft", "ours")
NPROC = 2  # processes per replica
# the DiLoCo paper's outer optimizer (Nesterov, lr 0.7, momentum 0.9), torchft's examples' too; our quality
# benchmark found streaming best there
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
ALPHA = 0.5  # streaming: fragment_alpha (ours' default) = torchft's fragment_update_alpha


@dataclass(frozen=True)
class V:
    """One run: which system, over what, which payload; F fragments and tau (streaming) or F = 1 (none)."""

    system: str  # torchft | ours
    transport: str  # gloo (torchft) | s3 | fs
    dtype: str  # fp32 (torchft) | our payload_dtype
    frags: int = 1
    tau: int = 0

    @property
    def overlap(self) -> str:
        return "streaming" if self.frags > 1 else "none"

    @property
    def label(self) -> str:
        stream = f" F={self.frags} tau={self.tau}" if self.frags > 1 else ""
        return f"{self.system} {self.transport} {self.dtype}, {self.overlap}{stream}"

    @property
    def name(self) -> str:
        return f"{self.system}-{self.transport}-{self.dtype}-f{self.frags}-t{self.tau}"


@dataclass(frozen=True)
class Sizes:
    model: dict
    batch: int
    h: int
    rounds: int
    sleep_s: float
    frags: int
    tau: int
    eval_windows: int
    payloads: tuple[str, ...]  # ours: fp32 (torchft's bytes), bf16 (our default)
    links: tuple[tuple[int, float], ...]  # (Mbit/s, RTT ms) of the emulated WAN; () = loopback only
    window_kb: int
    faults: tuple[str, ...]  # one | both | coordinator (on the first link, else on loopback)
    fault_rounds: int  # a fault run's length, in rounds of H
    fault_sleep_s: float  # its per-step sleep
    fault_step: int  # the fault comes when replica a has logged this step
    away_s: float  # a killed replica is started again this long after the kill
    outage_s: float  # the coordinator is down this long
    loopback: bool = True  # the side-by-side runs on loopback too (beside the links)
    subset: str | None = None  # the name of a subset of FULL's runs (SUBSETS)

    def variants(self, wan: bool) -> list[V]:
        tr = "s3" if wan else "fs"
        out = []
        for f, t in ((1, 0), (self.frags, self.tau)):
            out += [V("torchft", "gloo", "fp32", f, t), *(V("ours", tr, d, f, t) for d in self.payloads)]
        return out


FULL = Sizes(
    model={"n_layers": 4, "d_model": 384, "n_heads": 6, "seq_len": 32},
    batch=2,
    h=12,
    rounds=6,
    sleep_s=0.4,
    frags=4,
    tau=2,  # the most F=4 allows at H=12 (a fragment every 3 steps): the most room to hide a round
    eval_windows=512,
    payloads=("fp32", "bf16"),
    links=((400, 80.0), (100, 80.0)),
    # 4 MiB: this kernel's tcp_wmem maximum, the most one stream keeps in flight
    window_kb=4096,
    faults=("one", "both", "coordinator"),
    fault_rounds=12,
    fault_sleep_s=0.4,
    fault_step=30,  # mid-round (H=12): the round in flight is lost with the replica
    away_s=15.0,
    outage_s=30.0,
)
QUICK = Sizes(
    model={"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
    batch=1,
    h=4,
    rounds=2,
    sleep_s=0.0,
    frags=2,
    tau=1,
    eval_windows=32,
    payloads=("fp32",),
    links=(),
    window_kb=4096,
    faults=("one",),
    fault_rounds=10,
    fault_sleep_s=0.2,
    fault_step=6,
    away_s=1.0,
    outage_s=2.0,
)
# --subset NAME: FULL's sizes, fewer runs. goals: the runs issue 40's goals judge: the first link (400 Mbit/s,
# 80 ms), torchft against our default payload (bf16), without overlap and streaming, and the one-replica fault
SUBSETS = {
    "goals": replace(
        FULL, payloads=("bf16",), links=FULL.links[:1], faults=("one",), loopback=False, subset="goals"
    ),
}
