# One command each: `make demo` and `make test` build .venv themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/seed_mlp.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: $(STAMP) lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
