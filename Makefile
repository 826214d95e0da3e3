# Two commands do everything on a fresh machine: `make test` and `make demo`.
# Prerequisites: Python >= 3.10, Java 17+, Maven (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
AGL := $(BIN)/agl-stream

.PHONY: venv lock jars browser node-agent test lint typecheck demo bench clean

# The venv is installed by uv (from PyPI into the venv, then it installs the rest): with its
# cache, the whole set (torch, VERL, vLLM: ~7 GB) installs in seconds where pip took ~5 min,
# and constraints.txt pins every package to the versions the tests last passed with.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt -e '.[dev,train,frameworks]'
	@# superseded by opentelemetry-instrumentation-genai-openai: a venv made before keeps it, and both would patch openai
	$(BIN)/uv pip uninstall -q --python $(BIN)/python opentelemetry-instrumentation-openai-v2
	touch $(STAMP)

venv: $(STAMP)

# Resolve pyproject.toml's dependencies again (after changing them), keeping the versions of
# constraints.txt where they still fit, and write the result there.
lock: venv
	$(BIN)/uv pip compile -q pyproject.toml --extra dev --extra train --extra frameworks --custom-compile-command "make lock" -o constraints.txt

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

# The Node.js command agent of tests/integration/test_command_agents.py: the official openai
# package at the version its package-lock.json pins (npm ci; Node.js and npm are prerequisites).
NODE_AGENT := tests/agents/node
$(NODE_AGENT)/node_modules/.package-lock.json: $(NODE_AGENT)/package-lock.json
	cd $(NODE_AGENT) && npm ci --no-audit --no-fund --loglevel=error

node-agent: $(NODE_AGENT)/node_modules/.package-lock.json

test: venv jars browser node-agent
	$(BIN)/ruff check agl_stream processors producers consumers tests benchmarks scripts examples
	$(MAKE) --no-print-directory typecheck
	$(BIN)/lint-imports
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over all the code: one run for the packages, tests, benchmarks and scripts
# ([tool.mypy] files in pyproject.toml), then one run per example folder. Each example is a
# folder of scripts run as `python examples/<name>/train.py`, whose train.py imports its
# sibling agent module as a top-level module (the script's folder is on sys.path). In one run
# mypy would see three top-level modules named `train` ("Duplicate module named 'train'"), and
# explicit_package_bases/mypy_path cannot help: a folder on mypy_path makes its train.py the
# top-level `train` again, and without it the sibling import does not resolve. (The tests
# import the agent modules as examples.<name>.<module>, so the first run checks those too.)
# Its cache lives in the user's cache folder, not the clone: a fresh clone at the same path
# (CI's) checks in seconds instead of ~2.5 min; mypy validates every entry by content hash.
EXAMPLES := $(sort $(dir $(wildcard examples/*/*.py)))
typecheck: export MYPY_CACHE_DIR ?= $(HOME)/.cache/agl-stream/mypy
typecheck: venv
	$(BIN)/mypy
	set -e; for example in $(EXAMPLES); do $(BIN)/mypy $$example; done

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
