# Two commands on a fresh machine: `make demo` runs the demo, `make test` runs the tests (what CI runs).
#
# Both create a virtual environment in .venv first and install into it only, so they work with
# a system Python that refuses global installs (Debian/Ubuntu: "externally-managed-environment").
# Nothing is installed outside .venv; delete the folder to start over.
# `make docs` builds the documentation site (mkdocs.yml, docs/) into site/ with `mkdocs build --strict`.
# `make chromium` (run first by `make test`) installs Debian's chromium where it is missing, as root with apt-get: the
# tests render the built site in headless Chromium (tests/unit/test_docs_site.py). Not root, or no apt-get: it says so
# and installs nothing, and those tests skip with the reason.
# `make gpu-check` runs the GPU tier on the machine it starts on and writes its report (docs/gpu.md).
# `make gpu-bench` measures one GPU within 8 minutes (a ~1B GPT's MFU through raw torch, towers' loop and the
# Trainer; the Trainer against a raw loop on the seed CNN; memory policies) and writes gpu-bench.json and
# gpu-bench.md to towers-out/gpu-bench (docs/gpu.md). Without a GPU both exit 0 and say what they skipped.
#
# Variables (make VAR=value ...):
#   PYTHON       interpreter that creates .venv (default: python3)
#   VENV         where the virtual environment goes (default: .venv)
#   VENV_FLAGS   extra flags for `python -m venv`, e.g. --system-site-packages
#   TORCH        torch requirement installed before towers (default: torch==2.13.0)
#   TORCH_INDEX  package index for torch alone. On a machine without a GPU use PyTorch's CPU
#                wheels, which skip the multi-GB CUDA libraries that PyPI's Linux torch pulls in:
#                    make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   EXTRAS       extras installed with towers (default: test,docs: the test suite builds the docs site too)
#   DEMO_ARGS    flags for `towers demo`    (e.g. DEMO_ARGS="--epochs 2")
#   PYTEST_ARGS  arguments for pytest       (e.g. PYTEST_ARGS="tests/unit -x")
#   LINT         anything but 0 (default 1): `make test` first checks src/ with ruff and mypy (configured in
#                pyproject.toml); LINT=0 skips them
#   CHROMIUM     anything but 0 (default 1): `make test` first installs Debian's chromium where it is missing
#                (`make chromium`: as root, with apt-get); CHROMIUM=0 installs nothing (the browser tests then use
#                a chromium already there, or fail naming `make chromium` where root could have installed one)
#   GPU_PY       interpreter for `make gpu-check` (the GPU tier and its report, docs/gpu.md). Default: .venv's, made
#                as `make install` does where it is missing (CPU-only torch on a host without an NVIDIA driver);
#                without .venv, a $(PYTHON) whose torch sees a GPU is used as it is (nothing installed)
#   GPU_OUT      where `make gpu-check` writes gpu-report.json and gpu-report.md (default: towers-out/gpu-check)
#   GPU_ARGS     more flags for tools/gpu_check.py (e.g. GPU_ARGS="--no-bench")
#   GPU_BENCH_ARGS  flags for benchmarks/gpu_bench.py, run by `make gpu-bench` with GPU_PY chosen as for gpu-check
#                (e.g. GPU_BENCH_ARGS="--parts a --batch 16", "--out-dir /tmp/bench", "--device cpu --tiny")

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= test,docs
DEMO_ARGS ?=
PYTEST_ARGS ?=
LINT ?= 1
CHROMIUM ?= 1
GPU_PY ?=
GPU_OUT ?= towers-out/gpu-check
GPU_ARGS ?=
GPU_BENCH_ARGS ?=

VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
TORCH_INDEX_FLAGS := $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX),)
# Reinstall only when the package's metadata (dependencies, extras) or these settings change.
STAMP := $(VENV)/.towers-installed
SETTINGS := $(TORCH) $(TORCH_INDEX) $(EXTRAS)
# gpu-check on a host without an NVIDIA driver installs (if it must) CPU-only torch, never the CUDA build.
NVIDIA := $(wildcard /proc/driver/nvidia/version /dev/nvidiactl)
GPU_TORCH_INDEX := $(or $(strip $(TORCH_INDEX)),$(if $(NVIDIA),,https://download.pytorch.org/whl/cpu))

.PHONY: install chromium demo test docs bench gpu-check gpu-bench clean-venv

$(VPY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(PIP) install --quiet --disable-pip-version-check $(TORCH_INDEX_FLAGS) "$(TORCH)"
	$(PIP) install --quiet --disable-pip-version-check -e ".$(if $(strip $(EXTRAS)),[$(EXTRAS)],)"
	echo "$(strip $(SETTINGS))" > $(STAMP)

install: $(STAMP)
	@if [ "$$(cat $(STAMP))" != "$(strip $(SETTINGS))" ]; then rm -f $(STAMP) && $(MAKE) --no-print-directory $(STAMP); fi

# Debian's chromium for the tests that look at the built docs site; `apt-get update` only if the first try fails.
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium (the docs site tests render pages in it)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null \
		|| { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; \
	else echo "chromium is missing and cannot be installed here (needs root and apt-get): the docs site browser tests skip"; fi

demo: install
	$(VENV)/bin/towers demo $(DEMO_ARGS)

test: install $(if $(filter-out 0,$(strip $(CHROMIUM))),chromium,)
ifneq ($(strip $(LINT)),0)
	$(VPY) -m ruff check src
	$(VPY) -m mypy
endif
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# The documentation site into site/ (open site/index.html); every broken link or reference fails the build.
docs: install
	$(VPY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PIP) install --quiet --disable-pip-version-check -e ".[docs]"
	$(VPY) -m mkdocs build --strict --site-dir site

bench: install
	$(VENV)/bin/towers bench

# The interpreter of the GPU targets, into the shell variable py: GPU_PY; else, without .venv, a $(PYTHON) whose
# torch sees a GPU (nothing installed); else .venv's, made as `make install` does where it is missing (CPU-only torch
# on a host without an NVIDIA driver). An existing .venv is used as it is: no reinstall, no network.
PICK_GPU_PY = py="$(GPU_PY)"; \
	if [ -z "$$py" ] && [ ! -x $(VPY) ] && $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; \
	then py=$(PYTHON); fi; \
	if [ -z "$$py" ]; then \
		[ -f $(STAMP) ] || $(MAKE) --no-print-directory $(STAMP) TORCH_INDEX="$(GPU_TORCH_INDEX)" || exit 1; py=$(VPY); \
	fi

# The GPU tier on this machine, within 10 minutes; exits 0 on a machine without a GPU (every GPU check skipped).
gpu-check:
	@$(PICK_GPU_PY); \
	echo "$$py tools/gpu_check.py --out-dir $(GPU_OUT) $(GPU_ARGS)"; \
	$$py tools/gpu_check.py --out-dir $(GPU_OUT) $(GPU_ARGS)

# One GPU measured within 8 minutes; exits 0 on a machine without a GPU ("skipped: no GPU" in the report).
gpu-bench:
	@$(PICK_GPU_PY); \
	echo "$$py benchmarks/gpu_bench.py $(GPU_BENCH_ARGS)"; \
	$$py benchmarks/gpu_bench.py $(GPU_BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
