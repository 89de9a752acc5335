# Two entry points (see README): `make run` and `make test`. Everything lives in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := models/demo-olmoe
PROMPT ?= Once upon a time

.PHONY: run test setup setup-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The engine and the OLMoE plugin (runtime dependencies only).
setup: $(BIN)/python
	$(BIN)/pip install -q -e . -e plugins/olmoe -e plugins/qwen36

# Plus the test extra: pytest and the oracle (torch==2.13.0 CPU, transformers==5.23.0).
setup-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]' -e plugins/olmoe -e plugins/qwen36

$(DEMO)/colibri.yaml:
	$(BIN)/python tools/make_demo_model.py $(DEMO)

run: setup $(DEMO)/colibri.yaml
	$(BIN)/colibri run --model $(DEMO) --max-tokens 40 "$(PROMPT)"

test: setup-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) models build *.egg-info
