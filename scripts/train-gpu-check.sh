#!/usr/bin/env bash
# One short GPU run of the trainer: NCCL, bf16 autocast, the ~128M demo model (configs/gpt-125m.yaml).
# Prints tokens/s, MFU and HFU from the run's summary.json. No network: the data shard is prepared
# from this machine's Python stdlib.
#
#   scripts/train-gpu-check.sh [STEPS] [OUT_DIR]      (defaults: 60 steps, runs/gpu-check)
#
# Uses every visible GPU on this node (torchrun --standalone). Exit status: the trainer's.
set -euo pipefail

steps="${1:-60}"
out="${2:-runs/gpu-check}"
py="${PYTHON:-.venv/bin/python}"
torchrun="${TORCHRUN:-$(dirname "$py")/torchrun}"

ngpu="$("$py" -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$ngpu" -lt 1 ]]; then
  echo "train-gpu-check: no CUDA device visible" >&2
  exit 2
fi
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true

mkdir -p "$out"
export OMP_NUM_THREADS=4
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
rc=0
"$torchrun" --standalone --nproc-per-node "$ngpu" -m sbatch_gen.train \
  --config configs/gpt-125m.yaml --run-dir "$out/run" --data-path "$out/data" \
  --resume none --max-steps "$steps" 2>&1 | tee "$out/train.log" || rc=$?

"$py" - "$out/run" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
recs = [r for r in recs if "loss" in r]
tail = recs[len(recs) // 2:]  # steady state: the second half of the logged steps
mean = lambda k: sum(r[k] for r in tail if r.get(k) is not None) / max(1, sum(r.get(k) is not None for r in tail))
print(json.dumps({
    "device": s["device"], "world_size": s["world_size"], "steps": s["last_step"],
    "tokens_per_s_summary": s["tokens_per_s"], "tokens_per_s_steady": mean("tokens_per_s"),
    "mfu_steady": mean("mfu"), "hfu_steady": mean("hfu"), "step_time_p50_s": s["step_time_s"]["p50"],
    "step_time_p99_s": s["step_time_s"]["p99"], "mem_max_allocated_gib": max(r["mem_bytes"] for r in recs) / 2**30,
    "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
    "checkpoint_save_s": s["checkpoint_save_s"], "peak_flops": s["peak_flops"],
}, indent=2))
EOF
exit "$rc"
