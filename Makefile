# Two commands do everything on a fresh machine: `make test` and `make demo`.
# Prerequisites: Python >= 3.10, Java 17+, Maven (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
AGL := $(BIN)/agl-stream

.PHONY: venv jars browser test lint typecheck demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,train]'
	touch $(STAMP)

venv: $(STAMP)

# Resolves the Apache Kafka server jars from Maven Central with Maven (cached).
jars: venv
	$(AGL) kafka jars

# The test suite starts its own broker on free ports in a temporary folder and stops it
# (tests/conftest.py); set AGL_KAFKA_BOOTSTRAP to run it against an existing cluster. Two
# workers (pytest-xdist, one module per worker at a time, each with its own broker): the
# integration tests mostly wait on brokers and processes, so two overlap well on two cores.
# The dashboard's browser tests (tests/integration/test_dashboard.py) drive Debian's chromium:
# installed here when /usr/bin/chromium is missing (as root, or with sudo); the tests never
# download a browser, and fail saying so when there is none.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
	  || echo "could not install chromium: the dashboard's browser tests will fail"; \
	fi

test: venv jars browser
	$(BIN)/ruff check agl_stream processors producers consumers tests benchmarks scripts
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

# The main job: starts a local stack in .agl/demo, runs it, stops everything it started.
demo: venv jars
	$(AGL) --data-dir .agl/demo demo

# Throughput benchmarks (not tests): results in benchmarks/results/*.json.
bench: venv jars
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/store.py
	$(BIN)/python benchmarks/runners.py

clean:
	rm -rf $(VENV) .agl .pytest_cache .mypy_cache .ruff_cache
