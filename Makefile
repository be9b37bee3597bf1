# Everything a newcomer needs: `make demo` runs the main job, `make test` runs the tests.
# torch is installed first and pinned, so that pip takes the CPU build instead of
# resolving a multi-GB CUDA build on machines without a GPU.
PYTHON ?= python3
TORCH ?= torch==2.13.0

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install --quiet "$(TORCH)"
	$(PYTHON) -m pip install --quiet -e ".[test]"

demo: install
	towers demo

test: install
	$(PYTHON) -m pytest -q

bench: install
	towers bench
