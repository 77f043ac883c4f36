# slurm-resilience: the two commands a newcomer needs are `make demo` and `make test`.
# Both run as root on Debian (bookworm): they install Debian's Slurm, munge and
# Python packages when missing, then build the virtualenv at .venv/.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# Debian's own python3, so jobs running as ordinary users can execute .venv/bin/python.
PYTHON_SYS ?= /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := python3 python3-venv python3-dev gcc slurmctld slurmd slurm-client munge \
                libslurm-dev lua5.1 nvme-cli procps prometheus slurmdbd mariadb-server
PIP_EXTRAS := dev,s3,gpu,train
TORCH := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: help setup apt venv lint typecheck unit integration test test-leg test-legs \
        test-ansible demo bench sandbox-down clean

help:
	@echo "make demo   bring up a local Slurm sandbox and run the main scenario"
	@echo "make test   install what is needed, then ruff, mypy and pytest (unit + sandbox)"
	@echo "make bench  run the benchmarks in benchmarks/ (prints ratios against references)"
	@echo "make test-legs  the Slurm-facing tests on Slurm 24.11 (trixie) and 26.05 (sid) roots"
	@echo "make test-leg SUITE=trixie|sid  one of them"
	@echo "make test-ansible  roll out with ansible/site.yml onto a fresh Debian root, twice"
	@echo "make lint | typecheck | unit | integration | sandbox-down | clean"

apt:
	@missing=$$(for p in $(APT_PACKAGES); do \
	    dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; \
	  done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "make: run as root to install: $$missing" >&2; exit 1; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@# Debian starts the packaged daemons on install; the sandbox runs its own, so stop those.
	@for s in slurmctld slurmd munge prometheus slurmdbd mariadb; do \
	  systemctl is-active --quiet $$s 2>/dev/null && systemctl stop $$s 2>/dev/null || true; \
	done

$(VENV)/.installed: setup.cfg pyproject.toml | apt
	$(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[$(PIP_EXTRAS)]' '$(TORCH)'
	touch $@

venv: $(VENV)/.installed

spank/slurm_resilience.so: spank/slurm_resilience_spank.c spank/exports.map | apt
	$(MAKE) -s -C spank

setup: apt venv spank/slurm_resilience.so

lint: setup
	$(VENV)/bin/ruff check slurm_resilience tests benchmarks examples

typecheck: setup
	$(VENV)/bin/mypy

unit: setup
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

integration: setup
	$(PY) -m pytest tests/integration -q $(PYTEST_ARGS)

# The sandbox tests mostly wait (on Slurm's timers and the jobs they run), so the suite runs
# in PYTEST_WORKERS pytest-xdist processes side by side; each test starts its sandboxes
# on its own ports and state dirs (tests/conftest.py). PYTEST_WORKERS=0 runs it in one.
PYTEST_WORKERS ?= 3
test: setup lint typecheck
	$(PY) -m pytest tests -q -ra --durations=30 -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The host's Slurm is bookworm's 22.05 (`make test`); these run the Slurm-facing tests
# (.ci/leg-tests) against other Slurm versions, each in a cached Debian root (.ci/test-leg).
LEG_SUITES := trixie sid
SUITE ?= trixie

test-leg: setup
	.ci/test-leg $(SUITE) $(PYTEST_ARGS)

test-legs: setup
	@for s in $(LEG_SUITES); do $(MAKE) --no-print-directory test-leg SUITE=$$s || exit 1; done

# One target per leg, so that `make -j -O test-leg-trixie test-leg-sid test-ansible` (.ci/run)
# runs them side by side, each one's output kept in one piece.
LEG_TARGETS := $(addprefix test-leg-,$(LEG_SUITES))
.PHONY: $(LEG_TARGETS)
$(LEG_TARGETS): test-leg-%: setup
	.ci/test-leg $* $(PYTEST_ARGS)

# ansible-lint, then site.yml applied twice to a fresh debootstrap root (second run
# changed=0), then the sandbox inside that root gated by the hooks the role installed.
test-ansible: venv
	ansible/ci/test-rollout

demo: setup
	$(PY) examples/demo.py

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b; done

sandbox-down:
	-$(VENV)/bin/slurm-resilience sandbox down

clean: sandbox-down
	$(MAKE) -s -C spank clean
	rm -rf $(VENV) .sandbox .mypy_cache .ruff_cache .pytest_cache *.egg-info
