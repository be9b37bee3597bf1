# Two commands on a fresh machine: `make demo` runs the demo, `make test` runs the tests (what CI runs).
#
# Both create a virtual environment in .venv first and install into it only, so they work with
# a system Python that refuses global installs (Debian/Ubuntu: "externally-managed-environment").
# Nothing is installed outside .venv; delete the folder to start over.
#
# Variables (make VAR=value ...):
#   PYTHON       interpreter that creates .venv (default: python3)
#   VENV         where the virtual environment goes (default: .venv)
#   VENV_FLAGS   extra flags for `python -m venv`, e.g. --system-site-packages
#   TORCH        torch requirement installed before towers (default: torch==2.13.0)
#   TORCH_INDEX  package index for torch alone. On a machine without a GPU use PyTorch's CPU
#                wheels, which skip the multi-GB CUDA libraries that PyPI's Linux torch pulls in:
#                    make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   EXTRAS       extras installed with towers (default: test)
#   DEMO_ARGS    flags for `towers demo`    (e.g. DEMO_ARGS="--epochs 2")
#   PYTEST_ARGS  arguments for pytest       (e.g. PYTEST_ARGS="tests/unit -x")
#   LINT         anything but 0 (default 1): `make test` first checks src/ with ruff and mypy (configured in
#                pyproject.toml); LINT=0 skips them

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= test
DEMO_ARGS ?=
PYTEST_ARGS ?=
LINT ?= 1

VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
TORCH_INDEX_FLAGS := $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX),)
# Reinstall only when the package's metadata (dependencies, extras) or these settings change.
STAMP := $(VENV)/.towers-installed
SETTINGS := $(TORCH) $(TORCH_INDEX) $(EXTRAS)

.PHONY: install demo test bench clean-venv

$(VPY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(PIP) install --quiet --disable-pip-version-check $(TORCH_INDEX_FLAGS) "$(TORCH)"
	$(PIP) install --quiet --disable-pip-version-check -e ".$(if $(strip $(EXTRAS)),[$(EXTRAS)],)"
	echo "$(strip $(SETTINGS))" > $(STAMP)

install: $(STAMP)
	@if [ "$$(cat $(STAMP))" != "$(strip $(SETTINGS))" ]; then rm -f $(STAMP) && $(MAKE) --no-print-directory $(STAMP); fi

demo: install
	$(VENV)/bin/towers demo $(DEMO_ARGS)

test: install
ifneq ($(strip $(LINT)),0)
	$(VPY) -m ruff check src
	$(VPY) -m mypy
endif
	$(VPY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/towers bench

clean-venv:
	rm -rf $(VENV)
