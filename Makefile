# The few targets a newcomer needs. `make demo` and `make test` do all set-up themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean jdbc chromium

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# JDBC drivers for the Spark reconciliation come from Debian (Maven Central is not reachable).
jdbc:
	@bash scripts/ensure-jdbc.sh

# Chromium for the console's browser tests comes from Debian too (no browser download).
chromium:
	@bash scripts/ensure-chromium.sh

demo: $(STAMP) jdbc
	$(BIN)/python -m examples.demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP) jdbc chromium lint
	$(BIN)/python -m pytest tests

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

bench: $(STAMP)
	@echo "See bench/README.md: each benchmark is run on its own, e.g. $(BIN)/python bench/flow.py or $(BIN)/python bench/peers.py"

clean:
	rm -rf $(VENV) .demo .mypy_cache .ruff_cache .pytest_cache
