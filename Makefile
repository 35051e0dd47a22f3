# One command each: `make demo` and `make test` build .venv themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint gpu-check bench screenshots clean

# constraints.txt pins torch to the CPU wheel on this disk, so that no dependency pulls another torch.
$(STAMP): pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/seed_mlp.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two pytest-xdist workers, one per core of CI's two (each computes on one torch thread: tests/conftest.py).
# --dist loadscope keeps each test module on one worker, so that its module-scoped fixtures (subprocess runs,
# real fits, a TensorBoard server) run once. (--dist loadgroup's xdist_group marks do not group under pytest 9.)
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadscope

test: $(STAMP) lint
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

# The tests not marked slow (no subprocess runs, DDP, torch.compile or long fits): a quick check while editing.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

# The prepared CUDA check (benchmarks/gpu_check.py: measured on the device beside the callback and the predictions).
# It runs on the GPU machine's own python3, which holds a CUDA torch and lightning: nothing is installed. It writes
# results.json and results.md into OUT as it goes, and starts no section once BUDGET_S seconds are nearly spent.
GPU_PYTHON ?= python3
OUT ?= build/gpu_check
BUDGET_S ?= 420
gpu-check:
	PYTHONPATH=src PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT) --budget-s $(BUDGET_S)

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# The TensorBoard screenshots under docs/: a seed run, a real tensorboard, headless Chromium (Debian's package).
# Not part of `make test`.
screenshots: $(STAMP)
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	$(PY) scripts/screenshots.py --out docs

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
