#!/usr/bin/env bash
# One pre-commit hook of .pre-commit-config.yaml, with the project's own tools: .venv/bin when the clone
# has one (make install), else whatever is on PATH.
#   scripts/pre-commit-hook.sh validate|check       # sbatch-gen, for sites/ and examples/sites/
#   scripts/pre-commit-hook.sh ruff|ruff-format FILE...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tool() {
  if [ -x ".venv/bin/$1" ]; then echo ".venv/bin/$1"; return; fi
  command -v "$1" >/dev/null || { echo "pre-commit-hook: $1 not found: run make install first" >&2; exit 2; }
  echo "$1"
}
what="${1:?usage: scripts/pre-commit-hook.sh validate|check|ruff|ruff-format [FILE...]}"
shift
case "$what" in
  validate)
    sg="$(tool sbatch-gen)"
    "$sg" validate
    "$sg" validate --sites-dir examples/sites
    ;;
  check)
    sg="$(tool sbatch-gen)"
    "$sg" check
    "$sg" check --sites-dir examples/sites --out examples/out
    ;;
  ruff) "$(tool ruff)" check "$@" ;;
  ruff-format) "$(tool ruff)" format --check "$@" ;;
  *) echo "pre-commit-hook: unknown hook $what" >&2; exit 2 ;;
esac
