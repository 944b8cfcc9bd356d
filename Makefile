# Two entry points: `make demo` (set up, then run the benchmark) and `make test` (set up, then
# lint, type-check and run the whole test suite). Both build .venv from scratch when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob

.PHONY: demo test lint gpu-test test-torch clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# the CPU build of torch first: an open range would download a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# the Azure Blob Storage emulator of the az:// tests (node and npm are needed for it only)
$(AZURITE):
	npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@3.37.0

demo: $(STAMP)
	$(VENV)/bin/ckptstream bench

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

test: lint $(AZURITE)
	$(VENV)/bin/pytest -m "not gpu and not slow" --durations=30

# the CPU suite under another torch release, in a venv of its own (CUDA builds: GBs to download)
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.4.1"; exit 2; }
	PYTHON=$(PYTHON) .ci/torch-matrix $(TORCH)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
