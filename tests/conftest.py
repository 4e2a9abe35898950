"""Tiny randomly initialised models built from configs: every test runs on a CPU in well under a second.

Tests that ask for identical tokens across batch sizes, paddings, attention paths or caches build the
model in float64 (`tiny_model(dtype=F64)`): another CPU's BLAS kernels (AVX-512, AMX, another thread
count) round float32 differently, by about 1e-7, which flips a near-tied argmax or sampled pick and
every token after it; in float64 the same differences are about 1e-16 and never reach a decision.
`make test-other-isa` runs the suite under other kernels (docs/install.md).
"""

from __future__ import annotations

import gc
import os

# vLLM's n-gram proposer runs numba, whose OpenMP layer shares torch's OpenMP runtime and leaves its thread count
# at numba's (2 here) in the test process; a later in-process engine's CPU attention then builds its schedule for
# one thread count and runs with another ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)",
# seen in CI). numba's own thread pool leaves torch's alone. Set before numba is imported.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import sys  # noqa: E402

# vLLM freezes the whole heap when an engine starts (its own objects included) and thaws it at the engine's shutdown
# so that they can be finalized. In the suite, with its many in-process engines, every thaw made each of the next
# full collections (three in a shutdown, four to six in the next start) scan every imported module again: about
# 0.5 s each; those in vLLM's shutdowns alone took 84 s of the two workers' time in `make test` (2026-12-06). In
# the test process vLLM's own freeze and thaw are skipped: the suite freezes the heap at each file's start
# (`pytest_runtest_setup`), its engines are never frozen, and the collections vLLM runs scan only what the file made.
_freeze, _unfreeze = gc.freeze, gc.unfreeze


def _unless_vllm(real):
    def call() -> None:
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("vllm."):
            real()
    return call


gc.freeze, gc.unfreeze = _unless_vllm(_freeze), _unless_vllm(_unfreeze)

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 96
F64 = torch.float64

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP threads
# that wait for each other make small matmuls many times slower. VASE_TEST_THREADS=2 runs the
# suite with another thread count (another BLAS blocking: the rounding of another machine).
torch.set_num_threads(int(os.environ.get("VASE_TEST_THREADS", "1")))


def tiny_model(arch: str = "qwen3", attn: str = "sdpa", seed: int = 0, layers: int = 2,
               dtype: torch.dtype = torch.float32):
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 16) with random weights.

    The weights are drawn in float32 from `seed`, then cast to `dtype`: the float64 model holds the
    same weights (exactly), so it decodes like the float32 one up to float32 rounding.
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  attn_implementation=attn, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2,
                  bos_token_id=VOCAB - 3)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII, with pad and eos, left padding."""
    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"<bos>": VOCAB - 3, "<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.padding_side = "left"
    return tok


@pytest.fixture
def qwen3():
    return tiny_model("qwen3")


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny model and tokenizer saved to a folder, as a user's local checkpoint (one per test module)."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the `vase` CLI in-process: (exit code, stdout, stderr), SystemExit turned into its code."""
    # from the submodule: once `vase.cli.main` is imported (`from vase.cli import app` loads it), the package's
    # `main` attribute is that module, not the function (seen: test_eval_report then test_request_carried)
    from vase.cli.main import main

    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


#: The test files that take longest, about longest first (per-file sums of a `--junitxml` run of `make test`'s
#: command, 2026-12-05). `make test` hands whole files to its workers (`--dist loadfile`) in collection order
#: (`--no-loadscope-reorder`), so these start first and the short files fill both workers at the end; xdist's
#: own order (most tests first) left the few-test vLLM files (tp, dp, moe) for last on one worker. test_vllm_tp
#: goes first and test_vllm_dp and test_vllm_pp later: it makes the degree-1 run the three share
#: (`tests.vllm_parallel.single_engine`), which the other two would otherwise wait for on their worker.
SLOW_FIRST: tuple[str, ...] = (
    "test_vllm_tp.py", "test_vllm_plugin.py", "test_compile.py", "test_vllm_spec.py", "test_static_generate.py",
    "test_vllm_linear.py", "test_vllm_spec_draft.py", "test_vllm_eval.py", "test_vllm_spec_eagle.py", "test_vllm_mla.py",
    "test_vllm_hybrid.py", "test_vllm_dp.py", "test_models.py", "test_vllm_scale_bench.py",
    "test_vllm_bench.py", "test_vllm_pp.py", "test_vllm_serve.py", "test_vllm_exact.py", "test_bench.py",
    "test_cli.py", "test_vllm_prefix.py", "test_gpu_check.py", "test_vllm_llama4.py", "test_quant.py",
    "test_import_weight.py", "test_eval_runner.py", "test_vllm_moe.py", "test_vllm_mla_moe.py", "test_hybrid.py",
    "test_cache.py", "test_eval_report.py",
)


#: the test file whose tests run now
_CURRENT_FILE: list = [None]


def pytest_runtest_setup(item) -> None:
    """At each test file's start (the first one's included), collect and freeze what lives (torch, transformers,
    vLLM, the test modules: about half a million objects) out of the garbage collector's sight: a full collection
    (vLLM's in an engine's start and shutdown, the bench's one before each run) then scans only what the tests made,
    not every imported module again. Again at every file: what the last file imported (vLLM) joins the frozen heap,
    and its engines, released by then, are collected first (vLLM's own freeze and thaw are skipped: above).
    Measured in `make test` (2026-12-06) before the per-file freeze: 543 full collections took 202 s of the two
    workers' time; test_bench.py's 35 took 24 s. Once a file, not per test: a check of the heap
    (`gc.get_freeze_count()` walks the frozen objects) costs 0.07 s, as a collection of a frozen heap does."""
    if item.path != _CURRENT_FILE[0]:
        _CURRENT_FILE[0] = item.path
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config) -> None:
    """Hand the frozen objects back to the collector for the interpreter's shutdown (nanobind, triton's bindings,
    reports leaked instances otherwise)."""
    gc.unfreeze()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Move the files of SLOW_FIRST to the front, in that order; every file's own items keep their order."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def validations(monkeypatch):
    """The `RequestSpec.validate` calls so far, one entry each (reset with ``validations.clear()``)."""
    from vase.core.spec import RequestSpec

    calls: list = []
    real = RequestSpec.validate

    def counting(self, engine=None):
        calls.append(self)
        return real(self, engine)

    monkeypatch.setattr(RequestSpec, "validate", counting)
    return calls
