"""Read the metric sinks back with each project's own reader, as {scalar name: {step: value}}.

- TensorBoard: its EventAccumulator (which applies ``purge_step``, as TensorBoard does);
- W&B: its own transaction-log reader (``wandb leet inspect``, text when not on a terminal), each record
  parsed back into W&B's protobuf ``Record``; every offline run of the run dir, oldest first;
- Prometheus: prometheus_client's text parser.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"tensorboard {tag}: a step twice: {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def wandb_runs(run_dir: Path) -> list[Path]:
    """The offline runs' transaction logs, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_records(path: Path) -> list:
    from google.protobuf import text_format
    from wandb.proto import wandb_internal_pb2 as pb

    wandb = Path(sys.executable).parent / "wandb"
    text = subprocess.run(
        [str(wandb), "leet", "inspect", str(path)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    out = []
    for chunk in re.split(r"^# record \d+: \S+\n", text, flags=re.M)[1:]:
        rec = pb.Record()
        text_format.Parse(chunk, rec, allow_unknown_field=True)
        out.append(rec)
    return out


def wandb_scalars(run_dir: Path) -> tuple[dict[str, dict[int, float]], list]:
    """({name: {step: value}} over every attempt, [the run record of each attempt]); a step logged twice
    fails."""
    out: dict[str, dict[int, float]] = {}
    runs = []
    for path in wandb_runs(run_dir):
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                runs.append(rec.run)
            if kind != "history":
                continue
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            step = int(items.pop("_step"))
            for name, v in items.items():
                if name.startswith("_"):
                    continue
                assert step not in out.setdefault(name, {}), f"wandb {name}: step {step} twice"
                out[name][step] = v
    return out, runs


def prometheus_samples(path: Path) -> dict[str, tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out[s.name] = (s.labels, s.value)
    return out
