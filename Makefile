# The two commands a newcomer runs:  `make serve`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned and installed first: the pinned CPU build is on this machine's disk,
# an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup serve test test-fast lint bench clean

$(BIN)/shapeserve: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/shapeserve

serve: setup
	$(BIN)/shapeserve serve

test: setup
	$(BIN)/python -m pytest -q

# The gate CI runs before the tests: lint and types, configured in pyproject.toml.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
