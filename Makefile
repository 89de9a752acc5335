# Two entry points (see README): `make run` and `make test`. Everything lives in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Once upon a time

.PHONY: run test setup setup-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The engine and the shipped plugins (runtime dependencies only).
setup: $(BIN)/python
	$(BIN)/pip install -q -e . -e plugins/olmoe -e plugins/glm52 -e plugins/qwen36 -e plugins/kimi_k3

# Plus the test extra: pytest and the oracle (torch==2.13.0 CPU, transformers==5.23.0), and the
# example third-party plugin docs/plugins.md builds (its tests run with the others).
setup-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]' -e plugins/olmoe -e plugins/glm52 -e plugins/qwen36 -e plugins/kimi_k3 -e examples/qwen3moe

# The bundled demo model (colibri_core/demo/colibri-demo-kjv) is the default when no --model is given.
run: setup
	$(BIN)/colibri run --max-tokens 60 --temperature 0 "$(PROMPT)"

test: setup-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) models build *.egg-info
