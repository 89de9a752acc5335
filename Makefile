# Two entry points (see README): `make run` and `make test`. Everything lives in .venv.
# CI (.ci/run) also runs `make check-dist`: the wheels, installed into a fresh venv and used from there.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Once upon a time
# Every plugin under plugins/: a new plugins/NAME/ with a pyproject.toml is picked up as it is.
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))

.PHONY: run test test-fast setup setup-test check-dist clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The engine and the shipped plugins (runtime dependencies only).
setup: $(BIN)/python
	$(BIN)/pip install -q -e . $(addprefix -e ,$(PLUGINS))

# Plus the test extra: pytest and the oracle (torch==2.13.0 CPU, transformers==5.23.0), and the
# example third-party plugin docs/plugins.md builds (its tests run with the others).
setup-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]' $(addprefix -e ,$(PLUGINS)) -e examples/qwen3moe

# The bundled demo model (colibri_core/demo/colibri-demo-kjv) is the default when no --model is given.
run: setup
	$(BIN)/colibri run --max-tokens 60 --temperature 0 "$(PROMPT)"

# Both tiers. The system tier (tests marked `system`: soak and load, the Ray cluster, the browser,
# kill -9 campaigns, fuzzing, every tool under tools/ run once) takes minutes; `make test-fast`
# leaves it out: the loop to iterate in.
test: setup-test
	$(BIN)/python -m pytest -q

test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not system"

# Packaging (tools/check_dist.sh): sdist + wheel of colibri and of every plugin into dist/, the wheels
# installed (no -e) into a fresh venv outside the checkout: colibri run on the bundled demo, plugins,
# install/uninstall, and each plugin's tests against the installed wheels.
check-dist: setup-test
	tools/check_dist.sh

clean:
	rm -rf $(VENV) models build dist *.egg-info
