# Two commands: `make up` starts the whole local stack, `make test` runs the tests.
# Both create (or reuse) the virtual environment and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test install bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.local-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[local]'
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.local-installed
	$(BIN)/python -m pip install -q -e '.[local,test]'
	touch $@

install: $(VENV)/.test-installed

up: $(VENV)/.local-installed
	$(BIN)/gateway up

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.test-installed
	$(BIN)/python bench/gateway_bench.py

clean:
	rm -rf $(VENV) .stack
