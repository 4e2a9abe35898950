"""The eval's K/V columns computed two ways agree: from the cache's own per-row stats (`EvictionCache.row_stats`)
and derived from the eviction schedule and the byte model (`QuantBytes`) when a generate_fn gives no per-row
stats. Dense and quantized storage (kv_bits 4, 8), a dense model and a hybrid one (Gemma 3: sliding layers
beside the evicting full-attention layer), float64 throughout.

Where the derivation cannot know a number (after an eviction, which full-precision entries of a quantized
cache survived depends on the policy's choices) it must leave the column empty (None), never print another
number; everything else must be equal exactly. The cache's own numbers are checked against the bytes a
cache fed the same lengths by hand holds at each step.
"""

from __future__ import annotations

import pytest
import torch

import vase
from vase.caches.eager import EvictionCache
from vase.hf.compat import CACHE_KWARG, cache_kwargs
from vase.eval.config import EvalConfig
from vase.eval.runner import run_eval
from vase.eval.store import read_all
from vase.eval.table import summary_rows

B, W = 24, 8
COLUMNS = ("evictions", "kv_bytes", "kv_bytes_peak", "kv_bytes_full", "kv_bytes_time_mean", "kv_bytes_allocated")
#: columns the schedule cannot know for a quantized cache once it evicted (the reserve's occupancy)
UNKNOWABLE = ("kv_bytes", "kv_bytes_time_mean")
SUMMARY = ("kv_peak_ratio", "kv_sum_ratio", "kv_bytes_peak_mean", "kv_bytes_time_mean", "kv_bytes_allocated_mean")


def _model(family: str):
    from tests.helpers_tiny import tiny_model_and_tokenizer, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    if family == "qwen3":
        return tiny_model_and_tokenizer(dtype=torch.float64)
    from .hybrid_models import hybrid_config

    tok = tiny_tokenizer()
    cfg = hybrid_config(family)
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = len(tok), 1, 0, None
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.float64).eval(), tok


def _without_rows(*args, **kwargs):
    out = vase.generate(*args, **kwargs)
    out.stats.pop("rows")
    return out


def _run(model, tok, tmp, bits, generate_fn=vase.generate):
    params = {} if bits is None else {"full-q": {"method": "full", "kv_bits": bits},
                                      "snapkv-q": {"method": "snapkv", "kv_bits": bits, "flush_every": 4}}
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"] if bits is None else list(params), budgets=[B], window=W, samples=1, max_new_tokens=30,
                     batch_size=2, model="tiny", output_dir=str(tmp), greedy=True, method_params=params)
    recs = read_all(run_eval(cfg, model, tok, progress=False, summarize=False, generate_fn=generate_fn))
    return {(r["method"], r["problem_id"]): r for r in recs}


class _Recorder:
    """A generate_fn (vase.generate, stats untouched) that keeps each call's prompts, options and completions."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, tok, prompts, **kwargs):
        out = vase.generate(model, tok, prompts, **kwargs)
        self.calls.append((list(prompts), kwargs, out))
        return out

    def find(self, rec, bits):
        """The prompt and options that produced record `rec` (`bits`: its kv_bits)."""
        for prompts, kwargs, out in self.calls:
            for r, ids in enumerate(out.token_ids):
                if list(ids) == rec["token_ids"] and kwargs["seed"][r] == rec["seed"] and \
                        getattr(kwargs["request"].storage, "bits", None) == bits and \
                        kwargs["request"].method == rec["method"].removesuffix("-q"):
                    return prompts[r], kwargs
        raise AssertionError(f"no call produced {rec['method']} {rec['problem_id']}")


def _held_by_hand(model, tok, prompt, kwargs):
    """The same generation alone (batch of 1): the cache's bytes after each forward (the prompt's first), and its
    bytes just before its first eviction (its peak stored length)."""
    held, evictions = [], []

    def hook(module, args, kw, output):
        stats = kw[CACHE_KWARG].stats()  # the keyword of this transformers version
        held.append(stats["kv_bytes"])
        evictions.append(stats["evictions"])

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        out = vase.generate(model, tok, [prompt], **{**kwargs, "seed": kwargs["seed"][:1]})
    finally:
        handle.remove()
    first = next((i for i, e in enumerate(evictions) if e), None)
    return out, held, (held[first - 1] if first is not None else None)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_kv_columns_from_the_cache_equal_the_derived_ones(tmp_path, family, bits):
    model, tok = _model(family)
    recorder = _Recorder()
    own = _run(model, tok, tmp_path / "own", bits, recorder)
    derived = _run(model, tok, tmp_path / "derived", bits, _without_rows)
    assert own.keys() == derived.keys()
    assert any(r["evictions"] > 0 for r in own.values())  # eviction really ran
    marked = 0
    for key, r in own.items():
        d = derived[key]
        assert d["token_ids"] == r["token_ids"], key
        for col in COLUMNS:
            if d[col] is None and bits is not None and key[0] == "snapkv-q" and r["evictions"] > 0 \
                    and col in UNKNOWABLE:
                marked += 1  # the derivation cannot know it: it says so
                continue
            assert d[col] == r[col], (key, col, r[col], d[col])
        assert all(r[col] is not None for col in COLUMNS), key  # the cache's own stats know every column
    assert marked == (0 if bits is None else 2 * sum(k[0] == "snapkv-q" and r["evictions"] > 0
                                                     for k, r in own.items()))
    # the summary's K/V columns (KV peak / full, KV avg / full, bytes): equal, or empty where a row was marked
    rows_own = {(r["method"], r["budget"]): r for r in summary_rows(list(own.values()), window=W)}
    rows_derived = {(r["method"], r["budget"]): r for r in summary_rows(list(derived.values()), window=W)}
    for key, r in rows_own.items():
        for col in SUMMARY:
            d = rows_derived[key].get(col)
            if not (d is None and marked and key[0] == "snapkv-q" and col in ("kv_sum_ratio", "kv_bytes_time_mean")):
                assert d == r.get(col), (key, col, r.get(col), d)

    # The cache's own numbers are what the cache held at each step of the same generation run alone.
    for r in own.values():
        if bits is None:
            continue
        prompt, kwargs = recorder.find(r, bits if r["method"].endswith("-q") else None)
        kwargs = {**kwargs, "seed": [r["seed"]]}
        out, held, before_first = _held_by_hand(model, tok, prompt, kwargs)
        assert list(out.token_ids[0]) == r["token_ids"]
        n = r["prompt_length"] + r["length"] - (0 if r["finished"] else 1) - r["prompt_length"]
        assert len(held) == 1 + n  # the prompt's forward, then one per token fed
        assert r["kv_bytes"] == held[-1], (r["method"], r["evictions"], held[-3:], len(held), n)
        assert r["kv_bytes_peak"] == (before_first if r["evictions"] else held[-1])
        assert r["kv_bytes_time_mean"] == pytest.approx(sum(held[1:]) / n, rel=1e-12)
