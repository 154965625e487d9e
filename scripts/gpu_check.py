"""One prepared GPU check of every trainer path: run by scripts/gpu-check.sh (read its header first).

Phases, each a real run of the trainer (``python -m sbatch_gen.train`` under torchrun on every visible GPU
of this node, NCCL, bf16 autocast) on the ~125M config (configs/gpt-125m.yaml) unless ``--smoke``:

  hbm        device-to-device copy bandwidth of this GPU (the yardstick for the outer step)
  ac-off     steady-state tokens/s, MFU, HFU and memory, activation checkpointing off
  ac-on      the same with activation checkpointing on (HFU counts the recomputed forward)
             (ac-off, ac-on and fsdp each record a few early steps with train.profile, ahead of the steady
             half their figures come from: the trace, and the device's time per step by kind of kernel)
  compiled   ac-off's run with train.compile (every block compiled in place): tokens/s and MFU against
             ac-off's, and the compile's own log line (the first steps include the compilation)
  async-dcp  asynchronous DCP saves every few steps: save time, steps slowed, every checkpoint complete
  stop       stop file mid-run -> checkpoint + .ack + exit 0 -> resume -> same final parameters as one
             uninterrupted run (deterministic mode: bitwise, else the largest difference is reported)
  diloco     DiLoCo with one region over the fs mailbox, outer step on the GPU: outer-step time against
             the bytes it must move and the copy bandwidth measured in phase hbm
  streaming  Streaming DiLoCo (overlap streaming, 4 fragments, the exchange behind 1-2 steps) with one
             region over the fs mailbox, outer state on the GPU: every fragment's rounds merged, the time
             a round's start and its merge held training up, the final join
  fsdp       FSDP2 (parallelism.kind fsdp) on one GPU, bf16: tokens/s, MFU and memory with the CPU offload
             off and on (offload must lower the device's peak), and stop -> resume bitwise as in phase stop;
             the FSDP collective timer's CUDA clock against a device copy (one GPU issues no collective)
  codec      the wire formats' encode and decode on the GPU (bench/sparse.py codec_times: 16 Mi fp32
             elements, the bytes in host memory): int8, int4 and sparse 1% and 3% in ms per million
             elements, and whether the sparse encoder writes the CPU's bytes and both decode to the same bits

``--smoke`` runs the same phases on the CPU with the tiny config in one process (gloo): the script's own
logic, tested by ``make test`` (tests/train/test_gpu_check.py). Its figures mean nothing.

Writes ``OUT/summary.json`` and ``OUT/summary.md`` and prints the table. Exit status: 0 when every phase
ran and passed its check, 1 otherwise (the table says which). Needs no network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from sbatch_gen.jsonl import complete_lines  # noqa: E402
from sbatch_gen.testing.faults import ENV_STEP_SLEEP, TRAINER, trainer_module  # noqa: E402
from sbatch_gen.xr_options import CrossRegion, FsTransport, to_argv  # noqa: E402

# The outer step (DiLoCo, Nesterov) must at least read the averaged delta, read and write the momentum and
# theta_outer (fp32 each) and write the fp32 parameters: 4 + 8 + 8 + 4 bytes per parameter.
OUTER_BYTES_PER_PARAM = 24
GIB = 2**30
MARKER = ".gpu-check"  # an --out holding it was made by this script and may be emptied


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", flush=True)


class Check:
    def __init__(self, out: Path, smoke: bool, steps: int, nproc: int, phase_timeout_s: float) -> None:
        self.out, self.smoke, self.steps, self.nproc = out, smoke, steps, nproc
        self.timeout = phase_timeout_s
        self.py = sys.executable
        self.rows: list[dict] = []
        base = REPO / "configs" / ("tiny.yaml" if smoke else "gpt-125m.yaml")
        self.base = yaml.safe_load(base.read_text())
        self.data = out / "data"

    # -- running the trainer -------------------------------------------------------------------------------
    def config(self, name: str, **over) -> Path:
        cfg = json.loads(json.dumps(self.base))
        cfg["train"].update(steps=max(self.steps * 2, 100), log_every=1)
        cfg["checkpoint"].update(every=10**6, export_safetensors=True)
        cfg["optim"]["warmup_steps"] = min(cfg["optim"].get("warmup_steps", 0), 10)
        if self.smoke:
            cfg["model"]["dropout"] = 0.0
        for dotted, v in over.items():
            sec, key = dotted.split("__")
            cfg.setdefault(sec, {})[key] = v
        path = self.out / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def command(
        self,
        cfg: Path,
        run: Path,
        resume: str,
        max_steps: int,
        extra: list[str],
        nproc: int,
        module: str = TRAINER,
    ) -> list[str]:
        data = (
            self.data.with_name("data-xr") if extra else self.data
        )  # (the trainer prepares shards on demand)
        train = [
            "--config",
            str(cfg),
            "--run-dir",
            str(run),
            "--data-path",
            str(data),
            "--resume",
            resume,
            "--max-steps",
            str(max_steps),
            *extra,
        ]
        if self.smoke:
            return [self.py, "-m", module, *train]
        torchrun = str(Path(self.py).parent / "torchrun")
        return [torchrun, "--standalone", f"--nproc-per-node={nproc}", "-m", module, *train]

    def train(
        self,
        name: str,
        cfg: Path,
        *,
        resume: str = "none",
        max_steps: int | None = None,
        extra: list[str] | None = None,
        stop_at: int | None = None,
        run: Path | None = None,
        env: dict | None = None,
        nproc: int | None = None,
    ) -> tuple[int, Path]:
        """One trainer run (on every GPU, or ``nproc`` of them); ``stop_at``: create the stop file once
        metrics show that step."""
        run = run or self.out / "runs" / name
        module = trainer_module(env)  # the trainer, or the trainer with the per-step sleep installed
        stop_file = run.parent / f"{run.name}.stop"
        stop_file.unlink(missing_ok=True)
        env = {
            **os.environ,
            "SBATCH_GEN_STOP_FILE": str(stop_file),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            **(env or {}),
        }
        env.setdefault("OMP_NUM_THREADS", "4")
        cmd = self.command(
            cfg, run, resume, max_steps or self.steps, extra or [], nproc or self.nproc, module
        )
        logf = self.out / "logs" / f"{name}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        log(f"{name}: {' '.join(cmd)}")
        with open(logf, "ab") as f:
            p = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )
            deadline = time.monotonic() + self.timeout
            try:
                while p.poll() is None:
                    if time.monotonic() > deadline:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        raise TimeoutError(f"{name}: no exit within {self.timeout:.0f} s (log: {logf})")
                    if stop_at is not None and not stop_file.exists() and last_step(run) >= stop_at:
                        stop_file.touch()
                    time.sleep(0.05)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        return p.returncode, run

    # -- phases --------------------------------------------------------------------------------------------
    def row(self, phase: str, ok: bool, figures: dict, note: str = "") -> None:
        self.rows.append({"phase": phase, "ok": ok, "figures": figures, "note": note})
        log(f"{phase}: {'ok' if ok else 'FAILED'} {json.dumps(figures)} {note}")

    def phase(self, name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # one phase failing must not hide the others' figures
            self.row(name, False, {}, f"{type(e).__name__}: {e}")
        self.rows[-1]["figures"]["wall_s"] = round(time.monotonic() - t0, 1)

    def hbm(self) -> None:
        self.copy_gbps = copy_bandwidth(self.smoke)
        self.row(
            "hbm",
            self.copy_gbps > 0,
            {"copy_GBps": round(self.copy_gbps, 1)},
            "read + write bytes of a device-to-device copy / time",
        )

    def throughput(self, ac: bool) -> None:
        name = "ac-on" if ac else "ac-off"
        cfg = self.config(name, model__activation_checkpointing=ac, train__profile=self.profile_window())
        rc, run = self.train(name, cfg)
        s = steady(run)
        peak = summary(run).get("peak_flops")
        s["peak_TFLOPs"] = rnd(peak / 1e12, 1) if peak else None
        ddp = log_lines(self.out / "logs" / f"{name}.log", "DDP: ")
        s["ddp"] = ddp[0] if ddp else None
        problems = []
        if rc != 0 or not s["steps"]:
            problems.append(f"exit {rc}, {s['steps']} step records")
        if not self.smoke and (not peak or s.get("max_reserved_GiB") is None):
            problems.append("no BF16 peak known for this device (MFU missing) or no CUDA memory figures")
        if ac and not self.smoke and not (s.get("hfu") or 0) > (s.get("mfu") or 0):
            problems.append("HFU not above MFU with activation checkpointing")
        want_ddp = "off" if self.nproc == 1 else "on"
        if not (s["ddp"] or "").startswith(want_ddp):
            problems.append(f"expected 'DDP: {want_ddp}' in the log")
        s.update(self.profiled(name, run, problems))
        self.row(name, not problems, s, "; ".join(problems))
        if not ac:
            self.ac_off = s

    def compiled(self) -> None:
        """ac-off with train.compile: the ratio of steady tokens/s to ac-off's (measured, never assumed)."""
        rc, run = self.train("compiled", self.config("compiled", train__compile=True))
        s = steady(run)
        said = log_lines(self.out / "logs" / "compiled.log", "train.compile: ")
        s["compile"] = said[0] if said else None
        s["first_step_s"] = rnd(summary(run).get("first_step_s"), 2)  # the compilation's step
        base = (getattr(self, "ac_off", None) or {}).get("tokens_per_s")
        s["vs_ac_off"] = rnd(s["tokens_per_s"] / base, 3) if base and s.get("tokens_per_s") else None
        problems = []
        if rc != 0 or not s["steps"]:
            problems.append(f"exit {rc}, {s['steps']} step records")
        if "compiled in place" not in (s["compile"] or ""):
            problems.append("no 'blocks compiled in place' line in the log")
        self.row("compiled", not problems, s, "; ".join(problems))

    def async_dcp(self) -> None:
        every = max(2, self.steps // 6)
        rc, run = self.train(
            "async-dcp",
            self.config(
                "async-dcp", checkpoint__every=every, checkpoint__async_save=True, checkpoint__keep_last=100
            ),
        )
        summ = summary(run)
        saves = summ.get("checkpoint_save_s") or {}
        complete = sorted(
            int(p.parent.name.split("-")[1]) for p in run.glob("checkpoints/step-*/COMPLETE.json")
        )
        want = list(range(every, self.steps + 1, every))
        if self.steps not in want:
            want.append(self.steps)
        s = steady(run)
        base = getattr(self, "ac_off", {}).get("step_p50_s")
        fig = {
            "saves": saves.get("count"),
            "save_mean_s": rnd(saves.get("mean")),
            "save_max_s": rnd(saves.get("max")),
            "complete": len(complete),
            "step_p50_s": s["step_p50_s"],
            "tokens_per_s": s["tokens_per_s"],
        }
        if base:
            fig["p50_vs_ac_off"] = round(s["step_p50_s"] / base, 3)
        missing = sorted(set(want) - set(complete))
        self.row(
            "async-dcp",
            rc == 0 and not missing,
            fig,
            f"missing complete checkpoints {missing}" if missing else f"checkpoints at {want}",
        )

    def stop_resume(self) -> None:
        ok, fig = self.interrupted("stop", self.config("stop", train__deterministic="on"))
        self.row(
            "stop",
            ok,
            fig,
            "bitwise equal to one uninterrupted run"
            if fig["max_abs_diff"] == 0.0
            else "NOT bitwise equal to one uninterrupted run (deterministic mode)",
        )

    def interrupted(self, name: str, cfg: Path, nproc: int | None = None) -> tuple[bool, dict]:
        """One uninterrupted run of ``cfg``, and one stopped by the stop file a third of the way in, then
        resumed: whether every exit and the ack are right and the final weights equal, and the figures."""
        rc_ref, ref = self.train(f"{name}-ref", cfg, nproc=nproc)
        stop_at = max(2, self.steps // 3)
        # paced (sleep after each step: the math is unchanged) so the stop file lands mid-run, not after it
        pace = {ENV_STEP_SLEEP: "0.3" if self.smoke else "0.1"}
        rc1, run = self.train(name, cfg, stop_at=stop_at, env=pace, nproc=nproc)
        stopped = summary(run).get("last_step")
        ack = run.parent / f"{run.name}.stop.ack"
        rc2, run = self.train(f"{name}-resume", cfg, resume="auto", run=run, nproc=nproc)
        diff = max_abs_diff(ref / "model.safetensors", run / "model.safetensors")
        fig = {
            "stop_exit": rc1,
            "stopped_at": stopped,
            "ack": ack.exists(),
            "resume_exit": rc2,
            "resumed_from": summary(run).get("resumed_from_step"),
            "max_abs_diff": diff,
        }
        return rc_ref == 0 and rc1 == 0 and ack.exists() and rc2 == 0 and diff == 0.0, fig

    def fsdp(self) -> None:
        """FSDP2 on one GPU (bf16 parameters, fp32 reduction): throughput and memory with the CPU offload
        off and on (the offload run is half as long: its optimizer step runs on the host), then stop ->
        resume against one uninterrupted run, offload off."""
        fig: dict = {}
        problems: list[str] = []
        for off in (False, True):
            name = "fsdp-offload" if off else "fsdp"
            prof = None if off else self.profile_window()
            cfg = self.config(
                name, parallelism__kind="fsdp", parallelism__cpu_offload=off, train__profile=prof
            )
            steps = max(4, self.steps // 2) if off else self.steps
            rc, run = self.train(name, cfg, max_steps=steps, nproc=1)
            s = steady(run)
            said = log_lines(self.out / "logs" / f"{name}.log", "FSDP: ")
            where = "cpu" if off or self.smoke else "cuda"
            if rc != 0 or not s["steps"]:
                problems.append(f"{name}: exit {rc}, {s['steps']} step records")
            if not said or f"parameters on {where}" not in said[0] or "1 ranks" not in said[0]:
                problems.append(f"{name}: expected 'FSDP: 1 ranks ... parameters on {where}' in the log")
            if not self.smoke and s.get("mfu") is None:
                problems.append(f"{name}: no MFU (BF16 peak unknown?)")
            # FSDP's collective times: present in every step record (0 here: one rank issues no collective)
            if any(r.get("fsdp_all_gather_s") is None for r in records(run) if "loss" in r):
                problems.append(f"{name}: a step record without fsdp_all_gather_s")
            pre = "offload_" if off else ""
            for k in ("tokens_per_s", "mfu", "max_allocated_GiB", "max_rss_GiB"):
                fig[pre + k] = s.get(k)
            if not off:
                fig.update(self.profiled(name, run, problems))
        dev, dev_off = fig.get("max_allocated_GiB"), fig.get("offload_max_allocated_GiB")
        if not self.smoke and not (dev and dev_off and dev_off < dev):
            problems.append("the CPU offload did not lower the device's peak allocated memory")
        cfg = self.config("fsdp-stop", parallelism__kind="fsdp", train__deterministic="on")
        ok, stop = self.interrupted("fsdp-stop", cfg, nproc=1)
        fig.update({f"stop_{k}": v for k, v in stop.items() if k in ("stopped_at", "resumed_from")})
        fig["stop_max_abs_diff"] = stop["max_abs_diff"]
        if not ok:
            problems.append("stop -> resume: not bitwise equal to one uninterrupted run, or a bad exit/ack")
        # the collective timer's own clock (one GPU issues no collective, so the runs above leave its CUDA
        # path unused): a device-to-device copy on a side stream, timed by it and timed apart
        timed_s, copy_s = timer_check(self.smoke)
        fig["timer_s"], fig["timer_vs_wall"] = rnd(timed_s, 6), rnd(timed_s / copy_s, 3)
        # (the CPU's clock is the host's, tested by the unit tests; a shared CPU's copies vary too much)
        if not (0 < timed_s / copy_s < float("inf") if self.smoke else 0.5 <= timed_s / copy_s <= 1.5):
            problems.append(f"the collective timer read {timed_s:.6f} s for a copy of {copy_s:.6f} s")
        checked = (
            "stop -> resume bitwise" if self.smoke else "offload lowers device memory; stop -> resume bitwise"
        ) + "; the collective timer reads a timed copy"
        self.row("fsdp", not problems, fig, "; ".join(problems) or checked)

    def profile_window(self) -> dict:
        """train.profile's steps for a profiled phase: a few steps past the warm-up and before the second
        half of the run, which the steady figures come from (profiled steps run slower)."""
        return {"start_step": max(2, self.steps // 4), "steps": min(3, max(1, self.steps // 6))}

    def profiled(self, name: str, run: Path, problems: list[str]) -> dict:
        """The figures of the run's profiler trace (rank 0's): its path under OUT, and on a GPU the
        device's time per profiled step by kind of kernel (:func:`trace_breakdown`)."""
        traces = sorted((run / "profile").glob("rank0.steps-*.json"))
        if not traces:
            problems.append(f"{name}: no profiler trace in {run / 'profile'}")
            return {"profile": None}
        fig: dict = {"profile": str(traces[0].relative_to(self.out))}
        try:
            fig.update(trace_breakdown(traces[0]))
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{name}: profiler trace unreadable: {type(e).__name__}: {e}")
            return fig
        if fig.get("prof_steps", 0) < 1:
            problems.append(f"{name}: no 'step N' range in the profiler trace")
        if not self.smoke and not fig.get("prof_device_ms"):
            problems.append(f"{name}: no CUDA kernel in the profiler trace")
        return fig

    def solo_region(self, run_id: str, h: int, mailbox: str, **kw) -> CrossRegion:
        """DiLoCo with one region over a fresh fs mailbox ``OUT/mailbox``, outer state where ``auto`` puts
        it (the GPU)."""
        shutil.rmtree(self.out / mailbox, ignore_errors=True)
        return CrossRegion(
            enabled=True,
            run_id=run_id,
            region="solo",
            regions=["solo"],
            sync="diloco",
            inner_steps=h,
            transport=FsTransport(root=str(self.out / mailbox)),
            outer_device="auto",
            **kw,
        )

    def diloco(self) -> None:
        h = max(2, self.steps // 5)
        xr = self.solo_region("gpu-check", h, "mailbox")
        rc, run = self.train("diloco", self.config("diloco"), extra=to_argv(xr))
        recs = records(run)
        rounds = [r for r in recs if "xr_round" in r and "loss" in r and r.get("xr_outer_step_s") is not None]
        state = next((r for r in recs if r.get("event") == "xr_outer_state"), {})
        n = state.get("numel")
        outer = sorted(r["xr_outer_step_s"] for r in rounds)
        fig = {"rounds": len(rounds), "outer_device": state.get("device"), "params": n}
        if outer:
            med = outer[len(outer) // 2]
            fig["outer_step_p50_s"] = rnd(med)
            if n and med > 0:
                gbps = OUTER_BYTES_PER_PARAM * n / med / 1e9
                fig["outer_GBps"] = round(gbps, 1)
                if getattr(self, "copy_gbps", 0):
                    fig["of_copy_bw"] = round(gbps / self.copy_gbps, 3)
        want_dev = "cpu" if self.smoke else "cuda"
        ok = rc == 0 and len(rounds) >= 2 and str(state.get("device", "")).startswith(want_dev)
        self.row("diloco", ok, fig, f"outer step must move >= {OUTER_BYTES_PER_PARAM} B/param")

    def streaming(self) -> None:
        frags = 4
        h = max(frags, self.steps // 5 // frags * frags)  # 60 steps: H 12, a round every 3 steps
        tau = min(2, h // frags - 1)
        xr = self.solo_region(
            "gpu-check-streaming",
            h,
            "mailbox-streaming",
            overlap="streaming",
            fragments=frags,
            fragment_delay_steps=tau,
        )
        rc, run = self.train("streaming", self.config("streaming"), extra=to_argv(xr))
        recs = records(run)
        merges = [r for r in recs if "xr_round" in r and "xr_fragment" in r]
        starts = [r["xr_exposed_s"] for r in recs if "xr_inflight" in r and "xr_round" not in r]
        state = next((r for r in recs if r.get("event") == "xr_outer_state"), {})
        final = [r for r in recs if r.get("event") == "xr_final_round"]
        fig = {
            "rounds": len(merges),
            "fragments_seen": len({r["xr_fragment"] for r in merges}),
            "tau": tau,
            "outer_device": state.get("device"),
        }
        if merges:
            fig["merge_exposed_p50_s"] = rnd(sorted(r["xr_exposed_s"] for r in merges)[len(merges) // 2])
        if starts:
            fig["start_exposed_p50_s"] = rnd(sorted(starts)[len(starts) // 2])
        if final:
            fig["final_join_s"] = rnd(final[0]["xr_exposed_s"])
        want_dev = "cpu" if self.smoke else "cuda"
        ok = (
            rc == 0
            and fig["fragments_seen"] == frags
            and bool(final) == (tau > 0)
            and str(state.get("device", "")).startswith(want_dev)
        )
        self.row(
            "streaming", ok, fig, f"every one of {frags} fragments merged; the last round joined at the end"
        )

    def codec(self) -> None:
        from bench.sparse import codec_times, same_bytes_as_cpu

        dev = "cpu" if self.smoke else "cuda"
        n = 1 << (16 if self.smoke else 24)
        rows = codec_times(n, reps=3 if self.smoke else 7, device=dev)
        same = same_bytes_as_cpu(1 << (16 if self.smoke else 22), dev)
        both = {r[0]: float(r[3]) for r in rows}
        fig = {f"{c.replace(' ', '_').replace('%', 'pct')}_ms_per_M": v for c, v in both.items()}
        fig["sparse_1pct_vs_int8"] = round(both["sparse 1%"] / both["int8"], 2)
        fig["sparse_same_bytes_as_cpu"] = same
        self.row(
            "codec",
            same and all(v > 0 for v in both.values()),
            fig,
            f"encode + decode of {n:,} fp32 elements on {dev}, median of the repeats; sparse_1pct_vs_int8: the "
            "issue-43 goal is <= 1 (on the CPU)",
        )

    def run(self, only: list[str]) -> int:
        phases = {
            "hbm": self.hbm,
            "ac-off": lambda: self.throughput(False),
            "ac-on": lambda: self.throughput(True),
            "compiled": self.compiled,
            "async-dcp": self.async_dcp,
            "stop": self.stop_resume,
            "diloco": self.diloco,
            "streaming": self.streaming,
            "fsdp": self.fsdp,
            "codec": self.codec,
        }
        for name, fn in phases.items():
            if not only or name in only:
                self.phase(name, fn)
        table = render_table(self.rows, self.header())
        (self.out / "summary.md").write_text(table)
        (self.out / "summary.json").write_text(
            json.dumps({"header": self.header(), "phases": self.rows}, indent=2)
        )
        print(table, flush=True)
        return 0 if self.rows and all(r["ok"] for r in self.rows) else 1

    def header(self) -> dict:
        import torch

        h = {
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "smoke": self.smoke,
            "steps": self.steps,
            "nproc": self.nproc,
        }
        if torch.cuda.is_available():
            h["device"] = torch.cuda.get_device_name(0)
            h["gpus"] = torch.cuda.device_count()
        else:
            h["device"] = "cpu"
        return h


# -- reading a run --------------------------------------------------------------------------------------------
def records(run: Path) -> list[dict]:
    lines, _ = complete_lines(run / "metrics.jsonl")
    return [json.loads(line) for line in lines if line.strip()]


def last_step(run: Path) -> int:
    lines, _ = complete_lines(run / "metrics.jsonl")  # a line being written is not one yet
    return max((json.loads(line).get("step", -1) for line in lines[-5:] if line.strip()), default=-1)


def log_lines(path: Path, prefix: str) -> list[str]:
    """What follows ``prefix`` on each line of a trainer log that has it."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line.split(prefix, 1)[1].strip() for line in lines if prefix in line]


def summary(run: Path) -> dict:
    p = run / "summary.json"
    return json.loads(p.read_text()) if p.exists() else {}


def rnd(v, n: int = 4):
    return None if v is None else round(float(v), n)


def steady(run: Path) -> dict:
    """Figures over the second half of the step records (warm-up excluded): tokens/s from the summed step
    times, MFU and HFU scaled from the summary's (which are derived from its own tokens/s), memory."""
    steps = [r for r in records(run) if "loss" in r and "step_time_s" in r]
    tail = steps[len(steps) // 2 :]
    s = summary(run)
    out: dict = {"steps": len(steps)}
    if not tail:
        return out
    times = sorted(r["step_time_s"] for r in tail)
    tps = s.get("tokens_per_step") or 0
    tokens_per_s = tps * len(tail) / sum(times) if sum(times) > 0 else None
    out.update(step_p50_s=rnd(times[len(times) // 2]), tokens_per_s=rnd(tokens_per_s, 1))
    if tokens_per_s and s.get("tokens_per_s"):
        scale = tokens_per_s / s["tokens_per_s"]
        for k in ("mfu", "hfu"):
            if s.get(k) is not None:
                out[k] = rnd(s[k] * scale)
    mem = s.get("memory") or {}
    for k in ("max_allocated_bytes", "max_reserved_bytes", "device_total_bytes", "max_rss_bytes"):
        if mem.get(k) is not None:
            out[k.replace("_bytes", "_GiB")] = round(mem[k] / GIB, 2)
    out["last_loss"] = rnd(steps[-1]["loss"])
    return out


def max_abs_diff(a: Path, b: Path) -> float | None:
    if not (a.exists() and b.exists()):
        return None
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        return float("inf")
    return max((float((x[k].double() - y[k].double()).abs().max()) for k in x), default=0.0)


# Kernel kinds of a CUDA trace, by name (the first that matches; NCCL first: its kernels are not math).
KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ampere_", "hopper_")),
)


def _kind(name: str) -> str:
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def _union_s(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (device streams overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _step_ranges(events: list[dict], cat: str) -> list[dict]:
    """The trace's ``step N`` ranges of category ``cat`` (``user_annotation``: the host's;
    ``gpu_user_annotation``: the device's, from the range's first kernel to its last), in time order."""
    return sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("cat") == cat and str(e.get("name", "")).startswith("step ")
        ),
        key=lambda e: float(e["ts"]),
    )


def trace_breakdown(path: Path) -> dict:
    """What a Chrome trace of train.profile's steps says, per profiled step (milliseconds), the first
    profiled step left out when there are more (it holds the profiler's own start): the host's step
    (``step N`` ranges); and where device events exist (a CUDA trace), over the device's ``step N`` ranges
    (from the first of them to the end of the last: the device's time for those steps), the device's busy
    time (the union of kernels, copies and sets over every stream), its share of that window, and the
    kernels' time by kind: ``matmul`` (GEMM kernels), ``attention`` (flash/fused attention), ``nccl``
    (collectives), ``copy`` (memcpy/memset), ``other`` (elementwise, norms, the optimizer...). The kinds
    sum the kernels' own times, so overlapping streams can make them sum past the busy time."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    host = _step_ranges(events, "user_annotation")
    fig: dict = {"prof_steps": len(host)}
    if not host:
        return fig
    host = host[1:] if len(host) > 1 else host
    fig["prof_step_ms"] = rnd(sum(float(e["dur"]) for e in host) / len(host) / 1e3, 3)
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not dev:
        return fig  # a CPU trace: no device events
    steps = _step_ranges(events, "gpu_user_annotation")
    steps = steps[1:] if len(steps) > 1 else steps
    if steps:
        lo = float(steps[0]["ts"])
        hi = max(float(e["ts"]) + float(e["dur"]) for e in steps)
    else:  # no device ranges: every device event, over the host's steps
        lo, hi = float("-inf"), float("inf")
    kinds = {"matmul": 0.0, "attention": 0.0, "nccl": 0.0, "copy": 0.0, "other": 0.0}
    spans: list[tuple[float, float]] = []
    for e in dev:
        a = max(lo, float(e["ts"]))
        z = min(hi, float(e["ts"]) + float(e.get("dur", 0)))
        if z <= a:
            continue
        spans.append((a, z))
        kinds["copy" if e["cat"] != "kernel" else _kind(str(e.get("name", "")))] += z - a
    n = len(steps) or len(host)
    window = hi - lo if steps else sum(float(e["dur"]) for e in host)
    busy_us = _union_s(spans)
    fig["prof_device_ms"] = rnd(busy_us / n / 1e3, 3)
    fig["prof_device_busy"] = rnd(busy_us / window, 3) if window > 0 else None
    for k, us in kinds.items():
        fig[f"prof_{k}_ms"] = rnd(us / n / 1e3, 3)
    return fig


def timer_check(smoke: bool) -> tuple[float, float]:
    """The FSDP collective timer (sbatch_gen/train/fsdp.py) around a 1 GiB device-to-device copy issued on a
    side stream, as FSDP issues its collectives (CPU: a 64 MiB copy, the host clock): (the seconds it read,
    the copy's own seconds, timed apart on the same stream, the best of 3)."""
    import torch

    from sbatch_gen.train.fsdp import CollectiveTimer

    cuda = not smoke
    dev = torch.device("cuda" if cuda else "cpu")
    n = (64 if smoke else 1024) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    timer = CollectiveTimer(cuda)
    ctx = torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext()
    read, own = [], []
    for _ in range(3):
        with ctx:
            timer.timed("all_gather", lambda: dst.copy_(src))
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src)
                b.record()
                b.synchronize()
                own.append(a.elapsed_time(b) / 1000.0)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                own.append(time.perf_counter() - t0)
        read.append(timer.take().seconds()["all_gather"])
    return min(read), min(own)


def copy_bandwidth(smoke: bool) -> float:
    """GB/s (1e9) of read + write of a device-to-device copy; the best of a few repeats."""
    import torch

    dev = torch.device("cpu" if smoke else "cuda")
    n = (64 if smoke else 2048) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3 if smoke else 10):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


def render_table(rows: list[dict], header: dict) -> str:
    lines = [
        f"gpu-check {header['date_utc']} UTC: {header['device']}"
        f"{' x' + str(header.get('gpus')) if header.get('gpus') else ''}, torch {header['torch']}, "
        f"CUDA {header['cuda']}, {header['steps']} steps per run{' (SMOKE: CPU, figures meaningless)' if header['smoke'] else ''}",
        "",
        "| phase | ok | figures | note |",
        "|---|---|---|---|",
    ]
    for r in rows:
        figs = ", ".join(f"{k} {v}" for k, v in r["figures"].items())
        lines.append(f"| {r['phase']} | {'yes' if r['ok'] else 'NO'} | {figs} | {r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu-check", help="output directory (emptied first)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 60; smoke: 8)")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny config, one process: test the script itself"
    )
    ap.add_argument("--phase", action="append", default=[], help="run only this phase (repeatable)")
    ap.add_argument(
        "--phase-timeout-s", type=float, default=None, help="per trainer run (default 150; smoke 120)"
    )
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out == REPO or out in REPO.parents:
        ap.error(f"--out {out}: refusing to empty it (it holds the checkout)")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        ap.error(
            f"--out {out}: refusing to empty it (not empty, and no {MARKER} from an earlier gpu-check in it)"
        )
    shutil.rmtree(out, ignore_errors=True)  # a rerun starts clean: no old metrics.jsonl appended to
    out.mkdir(parents=True)
    (out / MARKER).write_text("made by scripts/gpu-check.sh; emptied by its next run\n")
    steps = args.steps or (8 if args.smoke else 60)
    nproc = 1
    if not args.smoke:
        import torch

        nproc = torch.cuda.device_count()
        if nproc < 1:
            print(
                "gpu-check: no CUDA device visible (use --smoke to test the script on the CPU)",
                file=sys.stderr,
            )
            return 2
    timeout = args.phase_timeout_s or (120 if args.smoke else 150)
    return Check(out, args.smoke, steps, nproc, timeout).run(args.phase)


if __name__ == "__main__":
    sys.exit(main())
