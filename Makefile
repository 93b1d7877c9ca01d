# The commands of the README: `make train` (the main job), `make test` (the fast tier a developer runs between
# commits), `make test-all` (everything: what CI runs) and `make docs` (the documentation site). Each
# creates or reuses a virtual environment in .venv and installs what it needs. The tiers are pytest
# markers; tests/conftest.py states the rule.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# These machines keep a CPU build of torch 2.13.0 on disk; elsewhere pip picks a release from PyPI.
TORCH_SPEC ?= torch==2.13.0

# The fast tier on two pytest-xdist workers: the end-to-end tests one after the other on one, the unit and
# multi-process tests beside them (tests/conftest.py); about 4 minutes instead of 6-9. WORKERS= runs it in
# one process. `make test-all` (CI) runs the same way first without the end-to-end tests, then those alone
# in one process: they time hangs, stragglers and replacements (docs/development.md).
WORKERS ?= -n 2 --dist loadgroup

.PHONY: install train test test-all frameworks lint docs compat clean testbed

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" 2>/dev/null || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

train: install
	OMP_NUM_THREADS=1 $(VENV)/bin/lockstep train digits -n 2 --run-dir runs/digits

# Fast tier (<= 6 minutes on 2 cores): lint, types, unit, multi-process at world 2, one end-to-end smoke per
# CLI feature. Slowest 10 shown, to keep it fast.
test: lint
	$(PY) -m pytest -q -m "not slow" $(WORKERS) --durations=10

# Everything: what .ci/run runs, in two parts. The unit, multi-process and docs tests on two pytest-xdist
# workers (the multi-process ones one after the other on one of them, the rest beside them: tests/conftest.py);
# then the end-to-end tests (tests/cli, tests/gpu) alone, one after the other in one process (about 35
# minutes): they time hangs, stragglers and replacements, and nothing else competes with them for the cores.
# The slowest of each part are printed.
END_TO_END := tests/cli tests/gpu
test-all: lint frameworks
	$(PY) -m pytest -q $(WORKERS) --durations=15 $(addprefix --ignore=,$(END_TO_END)) tests
	$(PY) -m pytest -q --durations=25 $(END_TO_END)

# The frameworks' programs (tests/cli/test_frameworks.py: Hugging Face Trainer, Lightning, Accelerate) need
# the `frameworks` extra: `make test-all` installs it; `make test` does not need it (those tests skip).
frameworks: install
	$(PY) -c "import transformers, lightning, accelerate" 2>/dev/null || $(PY) -m pip install -q -e ".[frameworks]"

lint: install
	$(PY) -m ruff check src tests testbed benchmarks examples tools
	$(PY) -m ruff format --check src tests testbed benchmarks examples tools
	$(PY) -m mypy

# The documentation site (mkdocs.yml): docs/ plus the API reference from the docstrings, into site/ (git-ignored).
# --strict: a warning (a broken link or anchor, a page missing from the nav, a docstring that does not
# parse) fails the build. NO_MKDOCS_2_WARNING silences mkdocs-material's banner about its successor.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# torch's own DDP tests (in the torch wheel) on torch's DDP and on lockstep's: docs/compat/torch_ddp_tests.md.
# Long (tens of minutes on 2 cores); COMPAT_ARGS=--reuse-baseline reuses torch's column from the last JSON.
compat: install
	$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q -r tools/compat/requirements.txt
	OMP_NUM_THREADS=1 $(PY) tools/compat/run_torch_ddp_tests.py $(COMPAT_ARGS)

# The SLURM and multi-host tests (tests/cli/test_slurm*.py, test_multinode.py; in make test-all) run real daemons and
# network namespaces: as root, `make testbed` installs what they need once (.ci/run does it). The tests never
# install anything; without these packages they skip, naming this command. Keep in step with the PACKAGES
# of testbed/slurm_cluster.py and testbed/netns.py.
TESTBED_PACKAGES := slurm-wlm munge iproute2 util-linux

testbed:
	@if [ "$$(id -u)" != 0 ]; then echo "make testbed: run it as root (it installs $(TESTBED_PACKAGES) with apt-get)" >&2; exit 1; fi
	@command -v apt-get >/dev/null || { echo "make testbed: needs apt-get (Debian) to install $(TESTBED_PACKAGES)" >&2; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(TESTBED_PACKAGES) \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(TESTBED_PACKAGES); }

clean:
	rm -rf $(VENV) runs site .pytest_cache
