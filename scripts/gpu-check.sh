#!/usr/bin/env bash
# The GPU check: every GPU path of the trainer in one run of under 8 minutes on one H200, ending in one
# summary table (also written to OUT/summary.md and OUT/summary.json). Phases: HBM copy bandwidth; the
# ~125M config in bf16 with activation checkpointing off and on (tokens/s, MFU, HFU, memory), and compiled
# (train.compile, against ac-off); async DCP
# saves every few steps; stop file -> checkpoint -> resume, compared bitwise with one uninterrupted run;
# DiLoCo with one region over the fs mailbox, outer step on the GPU against the measured bandwidth;
# Streaming DiLoCo (4 fragments, the exchange behind 1-2 steps) likewise; FSDP2 on one GPU with the CPU
# offload off and on (tokens/s, MFU, memory), and its stop -> resume compared bitwise; the wire formats'
# encode and decode on the GPU (int8, int4, sparse). ac-off, ac-on and fsdp each profile 3 early steps
# (train.profile): the trace, and the device's time per step by kernel kind.
#
#   scripts/gpu-check.sh [--out DIR] [--steps N] [--phase NAME]...   (default: runs/gpu-check, 60 steps)
#   scripts/gpu-check.sh --smoke                                      (CPU, tiny: tests the script itself)
#
# Uses every visible GPU of this node (torchrun --standalone, NCCL); needs no network: the data shards
# are cut from this machine's Python stdlib. OUT is emptied first. Exit: 0 every phase passed, 1 a phase
# failed (the table says which), 2 no GPU visible.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-.venv/bin/python}"
exec "$py" scripts/gpu_check.py "$@"
