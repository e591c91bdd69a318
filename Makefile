# The two commands of the README: `make demo` and `make test`. Both create .venv if missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# constraints.txt pins torch==2.13.0: on the build machines pip takes that wheel from disk;
# a looser pin would download a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml setup.py constraints.txt
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tandem demo

# Whole files on TEST_WORKERS processes (a file's fixtures are made once), each (and the nodes
# it starts) with one OpenMP thread: two workers' torch pools fought mlx and each other for
# the cores; then the tests that time themselves against the machine, alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=12
	$(BIN)/python -m pytest -q -m serial

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
