# Every target installs what it needs (apt and pip) on a fresh Debian machine.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SG := $(VENV)/bin/sbatch-gen
PYTEST_ARGS ?=
# pytest-xdist processes for make test-fast and make test (tests/conftest.py groups what must run serially):
# make test gives two of them the end-to-end groups, one local Slurm cluster each, which mostly wait on Slurm;
# the third runs everything else from the start
TEST_WORKERS ?= 3
APT_PACKAGES := shellcheck lmod slurmctld slurmd slurm-client slurmdbd mariadb-server munge openssh-server iproute2 iptables procps psmisc tmux
# make screenshots only: a headless browser (and a font) for TensorBoard, tmux for the terminal screens
SCREENSHOT_APT_PACKAGES := chromium fonts-dejavu-core tmux

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(VENV)/.installed: pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[dev,train,s3,report,metrics,peer]'
	touch $@

install: $(VENV)/.installed  ## create .venv, install the package editable with dev extras

# $(call apt_install,PACKAGES): apt-get install those not installed yet (root); nothing once all are there
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

system-deps:  ## apt packages the tests use (shellcheck, Slurm, munge, sshd, tmux); no-op once present
	$(call apt_install,$(APT_PACKAGES))

render: install  ## render every site to out/
	$(SG) render --all

check: install  ## fail (exit 1, with a diff) if out/ differs from a fresh render
	$(SG) validate
	$(SG) check

lint: install  ## ruff check, ruff format --check, mypy on sbatch_gen/ and examples/, bash -n + shellcheck on every rendered script (no root)
	$(VENV)/bin/ruff check sbatch_gen tests bench scripts examples
	$(VENV)/bin/ruff format --check sbatch_gen tests bench scripts examples
	$(VENV)/bin/mypy
	for f in out/*.sbatch out/*.sh examples/out/*.sbatch examples/out/*.sh; do [ -e "$$f" ] || continue; bash -n "$$f"; $(VENV)/bin/shellcheck -x "$$f"; done
	$(VENV)/bin/shellcheck scripts/*.sh

format: install  ## rewrite the Python sources in the project's style (ruff format, ruff check --fix)
	$(VENV)/bin/ruff format sbatch_gen tests bench scripts examples
	$(VENV)/bin/ruff check --fix sbatch_gen tests bench scripts examples

test-fast: install  ## the unit tier: no real servers, no subprocess training, no Slurm; under a minute (TEST_WORKERS processes)
	$(PY) -m pytest -m "not slow and not e2e" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# torch 2.4.1 (torchrun without --signals-to-handle/--shutdown-timeout) in a venv of its own, once per machine, for
# tests/e2e/test_old_torch.py; a CUDA build (PyPI has no CPU one for it): 3.3 GB to download, 5 GB on disk
OLD_TORCH_VENV ?= $(HOME)/.cache/sbatch-gen/venv-torch2.4
export OLD_TORCH_VENV
$(OLD_TORCH_VENV)/.installed:
	$(PYTHON) -m venv --clear $(OLD_TORCH_VENV)
	$(OLD_TORCH_VENV)/bin/python -m pip install -q --disable-pip-version-check 'torch==2.4.1' 'numpy<2'
	touch $@

old-torch: $(OLD_TORCH_VENV)/.installed  ## torch 2.4.1 in a venv of its own (~/.cache/sbatch-gen), for the e2e test of an older torch

test: install system-deps old-torch  ## the whole test suite: unit, multi-process (torchrun/gloo), end to end on local Slurm (TEST_WORKERS processes)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

soak: install system-deps  ## SOAK_RUNS (20) multi-node jobs in a row on the local Slurm and as many two-host SSH launches, every other one stopped on purpose: not one Traceback in any log, unfiltered (root; about 10 min; starts the local Slurm cluster make test uses; not part of make test)
	$(PY) -m pytest tests/e2e/soak_slurm_no_traceback.py tests/ssh/soak_ssh_no_traceback.py -s -q $(PYTEST_ARGS)

demo: install  ## render the sites, then train two regions with DiLoCo over the fs mailbox and summarise
	$(SG) render --all
	$(PY) -m sbatch_gen.demo

screenshots: install  ## the pictures of docs/watching.md (docs/img/) from a tiny two-region run; installs chromium, tmux, rich
	$(call apt_install,$(SCREENSHOT_APT_PACKAGES))
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[docs]'
	$(PY) scripts/screenshots.py

bench: install system-deps  ## benchmarks: Markdown table + PNG plots in bench/results/
	@# the naive baseline shells out to `aws s3 cp`; awscli pins its own botocore, so not in .venv
	command -v aws >/dev/null || $(PYTHON) -m pip install -q awscli
	$(PY) -m bench

.PHONY: help install system-deps old-torch render check lint format test test-fast soak demo bench screenshots
