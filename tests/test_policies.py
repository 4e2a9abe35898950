"""Eviction policies checked against references written here from docs/methods.md (the selection, the score and each method).

The references are plain loops / tensor code in float64 and use none of the library's
helpers (no vase.core.policies.scores, no base helpers); only the public `select`,
`window_attention`, `sample_without_replacement` and `get_policy` are exercised.
Layout: keys/values [batch, kv_heads, n, head_dim], queries [batch, q_heads, window, head_dim].
"""

from __future__ import annotations

import math

import pytest
import torch

import vase.core.policies as P
from vase.core.policies import POLICIES, UnknownMethodError, get_policy, sample_without_replacement, window_attention

B, HKV, HQ, N, D, W, K = 2, 2, 4, 40, 8, 6, 20
SINKS = 4


# ---------------------------------------------------------------------------------------------
# inputs and references
# ---------------------------------------------------------------------------------------------
def make_inputs(seed: int = 0, b: int = B, hkv: int = HKV, hq: int = HQ, n: int = N, d: int = D, w: int = W):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, n, d, generator=g)
    values = torch.randn(b, hkv, n, d, generator=g) * (0.5 + torch.rand(b, hkv, n, 1, generator=g))
    queries = torch.randn(b, hq, w, d, generator=g)
    return keys, values, queries


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_attention(keys, queries, temperature: float = 1.0, kernel: int = 5, last_only: bool = False):
    """Section 2, literally: per query head softmax over candidates, mean over window, avg pool
    (zero padding, always divided by the kernel), then mean over the group's query heads."""
    b, hkv, n, d = keys.shape
    hq = queries.shape[1]
    g = hq // hkv
    p = kernel // 2
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for bi in range(b):
        for kv in range(hkv):
            k = keys[bi, kv].double()
            for j in range(g):
                q = queries[bi, kv * g + j].double()  # query head kv*g+j belongs to KV head kv
                if last_only:
                    q = q[-1:]
                a = torch.zeros(n, dtype=torch.float64)
                for t in range(q.shape[0]):
                    logits = [float(q[t] @ k[i]) / (math.sqrt(d) * temperature) for i in range(n)]
                    m = max(logits)
                    e = [math.exp(x - m) for x in logits]
                    z = sum(e)
                    a += torch.tensor([x / z for x in e], dtype=torch.float64)
                a /= q.shape[0]
                smooth = torch.tensor([sum(a[jj] for jj in range(i - p, i + p + 1) if 0 <= jj < n) / kernel
                                       for i in range(n)], dtype=torch.float64)
                out[bi, kv] += smooth / g
    return out


def ref_redundancy(keys):
    """R-KV: red_i = softmax_i(mean_j cos(k_i, k_j)), diagonal 0, mean over all N."""
    b, h, n, _ = keys.shape
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            k = keys[bi, hi].double()
            norms = [math.sqrt(float(k[i] @ k[i])) for i in range(n)]
            mean_cos = []
            for i in range(n):
                total = 0.0
                for j in range(n):
                    if i != j:
                        total += float(k[i] @ k[j]) / (norms[i] * norms[j])
                mean_cos.append(total / n)
            m = max(mean_cos)
            e = [math.exp(x - m) for x in mean_cos]
            out[bi, hi] = torch.tensor([x / sum(e) for x in e], dtype=torch.float64)
    return out


def ref_value_range(values):
    return values.double().amax(-1) - values.double().amin(-1)


def ref_dkv(keys, values, projection):
    """c_i = ||k_i G||^2 ||v_i G||^2 normalised per head; G shared by the heads of a row."""
    b, h, n, _ = keys.shape
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        G = projection[bi].double()
        for hi in range(h):
            for i in range(n):
                kg = keys[bi, hi, i].double() @ G
                vg = values[bi, hi, i].double() @ G
                out[bi, hi, i] = float((kg * kg).sum()) * float((vg * vg).sum())
            out[bi, hi] /= out[bi, hi].sum()
    return out


def assert_topk(idx: torch.Tensor, ref: torch.Tensor, k: int, exclude=None, tol: float = 1e-6):
    """idx [b, h, k] is the top-k of ref [b, h, n] (as a set, per (batch, head)), optionally
    among the candidates not in exclude[(bi, hi)]. Near-ties at the boundary (< tol) may swap."""
    b, h, n = ref.shape
    assert idx.shape == (b, h, k)
    for bi in range(b):
        for hi in range(h):
            banned = set(exclude[bi][hi]) if exclude is not None else set()
            allowed = [i for i in range(n) if i not in banned]
            r = {i: float(ref[bi, hi, i]) for i in allowed}
            order = sorted(allowed, key=lambda i: -r[i])
            expected = set(order[:k])
            got = idx[bi, hi].tolist()
            assert len(set(got)) == k, f"duplicates in {got}"
            if set(got) != expected:
                unsel = [i for i in allowed if i not in set(got)]
                assert set(got) <= set(allowed), f"({bi},{hi}) picked excluded: {set(got) - set(allowed)}"
                assert min(r[i] for i in got) >= max(r[i] for i in unsel) - tol, \
                    f"({bi},{hi}) kept {sorted(got)}, expected {sorted(expected)}"


def assert_valid(idx: torch.Tensor, b: int, h: int, n: int, k: int):
    assert idx.dtype == torch.long
    assert idx.shape == (b, h, k), f"shape {tuple(idx.shape)} != {(b, h, k)}"
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    for bi in range(b):
        for hi in range(h):
            assert len(set(idx[bi, hi].tolist())) == k, f"duplicates in row ({bi},{hi}): {idx[bi, hi].tolist()}"


def low_attention_inputs(region: range, seed: int = 1):
    """Queries share a direction u; keys in `region` point against it, so their attention is tiny."""
    keys, values, _ = make_inputs(seed)
    g = gen(seed + 100)
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    queries = 3.0 * u + 0.3 * torch.randn(B, HQ, W, D, generator=g)
    keys[:, :, list(region)] = -4.0 * u + 0.1 * torch.randn(B, HKV, len(region), D, generator=g)
    return keys, values, queries


# ---------------------------------------------------------------------------------------------
# section 2: the shared attention score
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel,temperature", [(5, 1.0), (1, 1.0), (5, 0.5), (3, 2.0), (7, 1.3)])
def test_window_attention_matches_reference(kernel, temperature):
    keys, _, queries = make_inputs(0)
    got = window_attention(keys, queries, temperature=temperature, smooth_kernel=kernel)
    assert got.dtype == torch.float32 and got.shape == (B, HKV, N)
    ref = ref_attention(keys, queries, temperature, kernel)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)


def test_window_attention_edges_divided_by_kernel():
    # with smoothing the mass near the edges is lost (zero padding divided by the full kernel)
    keys, _, queries = make_inputs(2)
    raw = window_attention(keys, queries, smooth_kernel=1)
    smooth = window_attention(keys, queries, smooth_kernel=5)
    torch.testing.assert_close(raw.sum(-1), torch.ones(B, HKV))
    # raw[0] is counted by 3 outputs (i = 0, 1, 2), raw[1] by 4, interior ones by 5
    edge = (2 * raw[..., 0] + raw[..., 1] + raw[..., -2] + 2 * raw[..., -1]) / 5
    torch.testing.assert_close(smooth.sum(-1), 1 - edge, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(smooth[..., 0], (raw[..., 0] + raw[..., 1] + raw[..., 2]) / 5)


def test_window_attention_gqa_grouping():
    # changing the queries of KV group 1 (query heads 2, 3) must not change KV head 0's score
    keys, _, queries = make_inputs(3)
    q2 = queries.clone()
    q2[:, 2:] = torch.randn(B, 2, W, D, generator=gen(9))
    a, b = window_attention(keys, queries), window_attention(keys, q2)
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert not torch.allclose(a[:, 1], b[:, 1])


# ---------------------------------------------------------------------------------------------
# deterministic policies against references
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_snapkv_topk(seed):
    keys, values, queries = make_inputs(seed)
    out = get_policy("snapkv").select(keys, values, queries, K)
    assert_valid(out, B, HKV, N, K)
    assert_topk(out, ref_attention(keys, queries), K)


def test_snapkv_temperature_and_kernel_params():
    keys, values, queries = make_inputs(4)
    out = get_policy("snapkv", temperature=0.7, smooth_kernel=3).select(keys, values, queries, K)
    assert_topk(out, ref_attention(keys, queries, 0.7, 3), K)


@pytest.mark.parametrize("lam", [0.5, 0.2])
def test_rkv_topk(lam):
    keys, values, queries = make_inputs(5)
    red = ref_redundancy(keys)
    s = ref_attention(keys, queries)
    out = get_policy("rkv", rkv_lambda=lam).select(keys, values, queries, K)
    assert_valid(out, B, HKV, N, K)
    assert_topk(out, lam * s - (1 - lam) * red, K)


def test_key_redundancy_matches_reference():
    keys, _, _ = make_inputs(5)
    torch.testing.assert_close(P.key_redundancy(keys).double(), ref_redundancy(keys), rtol=1e-5, atol=1e-8)
    # the mean runs over all N (zeroed diagonal included), not N - 1
    alt = ref_redundancy(keys * 1.0)
    k = torch.nn.functional.normalize(keys.double(), dim=-1)
    cos = k @ k.transpose(-1, -2) - torch.eye(N, dtype=torch.float64)
    wrong = (cos.sum(-1) / (N - 1)).softmax(-1)
    assert not torch.allclose(wrong, alt, rtol=1e-5, atol=1e-8)


def test_rkv_redundancy_matters():
    # near-duplicate keys are redundant: R-KV with lambda=0 keeps the least redundant ones
    keys, values, queries = make_inputs(6)
    keys[:, :, 10:20] = keys[:, :, 10:11] + 0.01 * torch.randn(B, HKV, 10, D, generator=gen(1))
    out = get_policy("rkv", rkv_lambda=0.0).select(keys, values, queries, K)
    assert_topk(out, -ref_redundancy(keys), K)
    for bi in range(B):
        for hi in range(HKV):
            assert len(set(out[bi, hi].tolist()) & set(range(10, 20))) <= 1


def test_tova_last_query_no_smoothing():
    keys, values, queries = make_inputs(7)
    out = get_policy("tova").select(keys, values, queries, K)
    assert_valid(out, B, HKV, N, K)
    assert_topk(out, ref_attention(keys, queries, kernel=1, last_only=True), K)
    # only the last query matters
    q2 = queries.clone()
    q2[:, :, :-1] = torch.randn(B, HQ, W - 1, D, generator=gen(3))
    assert torch.equal(out, get_policy("tova").select(keys, values, q2, K))


def test_knorm_smallest_key_norms():
    keys, values, queries = make_inputs(8)
    out = get_policy("knorm").select(keys, values, None, K)
    assert_valid(out, B, HKV, N, K)
    assert_topk(out, -keys.double().pow(2).sum(-1).sqrt(), K)


def test_streamingllm_sinks_and_recent():
    keys, values, _ = make_inputs(9)
    out = get_policy("streamingllm").select(keys, values, None, K)
    assert_valid(out, B, HKV, N, K)
    for bi in range(B):
        for hi in range(HKV):
            assert out[bi, hi, :SINKS].tolist() == list(range(SINKS))
            assert set(out[bi, hi, SINKS:].tolist()) == set(range(N - (K - SINKS), N))


def test_evict_large_v_smallest_ranges():
    keys, values, _ = make_inputs(10)
    out = get_policy("evict-large-v").select(keys, values, None, K)
    assert_valid(out, B, HKV, N, K)
    assert_topk(out, -ref_value_range(values), K)


@pytest.mark.parametrize("kernel", [1, 5])
def test_h2o_accumulates_in_place(kernel):
    keys, values, queries = make_inputs(11)
    acc0 = torch.rand(B, HKV, N, generator=gen(0)) * 0.05
    acc = acc0.clone()
    policy = get_policy("h2o", smooth_kernel=kernel)
    s = ref_attention(keys, queries, kernel=kernel)
    out = policy.select(keys, values, queries, K, accumulated=acc)
    assert_valid(out, B, HKV, N, K)
    torch.testing.assert_close(acc.double(), acc0.double() + s, rtol=1e-5, atol=1e-7)
    assert_topk(out, acc0.double() + s, K)
    # a second eviction accumulates again
    policy.select(keys, values, queries, K, accumulated=acc)
    torch.testing.assert_close(acc.double(), acc0.double() + 2 * s, rtol=1e-5, atol=1e-7)


def test_h2o_without_accumulator_is_windowed_score():
    keys, values, queries = make_inputs(12)
    out = get_policy("h2o").select(keys, values, queries, K)
    assert_topk(out, ref_attention(keys, queries, kernel=1), K)


def test_h2o_accumulator_dominates():
    # a large accumulated mass keeps a candidate even if the current window ignores it
    keys, values, queries = low_attention_inputs(range(26, 39))
    acc = torch.zeros(B, HKV, N)
    acc[..., 32] = 10.0
    out = get_policy("h2o").select(keys, values, queries, K, accumulated=acc)
    assert (out == 32).any(-1).all()


def projection_for(seed: int, rank: int = 20) -> torch.Tensor:
    return torch.randn(B, D, rank, generator=gen(seed)) / math.sqrt(rank)


@pytest.mark.parametrize("seed", [0, 1])
def test_curdkv_with_projection(seed):
    keys, values, _ = make_inputs(13 + seed)
    G = projection_for(seed)
    out = get_policy("curdkv").select(keys, values, None, K, projection=G)
    assert_valid(out, B, HKV, N, K)
    c = ref_dkv(keys, values, G)
    assert out[..., :SINKS].tolist() == [[list(range(SINKS))] * HKV] * B
    banned = [[list(range(SINKS))] * HKV] * B
    assert_topk(out[..., SINKS:], c, K - SINKS, exclude=banned)


def test_curdkv_rank_param():
    keys, values, _ = make_inputs(15)
    G = projection_for(3, rank=5)
    out = get_policy("curdkv", rank=5).select(keys, values, None, K, projection=G)
    banned = [[list(range(SINKS))] * HKV] * B
    assert_topk(out[..., SINKS:], ref_dkv(keys, values, G), K - SINKS, exclude=banned)


def test_vase_dkv_with_projection_equals_curdkv():
    keys, values, _ = make_inputs(16)
    G = projection_for(5)
    a = get_policy("curdkv").select(keys, values, None, K, projection=G)
    b = get_policy("vase-dkv").select(keys, values, None, K, projection=G, generator=gen(0))
    assert torch.equal(a, b)


def test_vase_dkv_projection_shared_by_heads_and_redrawn():
    # the heads of a row share G: identical heads select identically
    keys, values, _ = make_inputs(17)
    keys[:, 1], values[:, 1] = keys[:, 0], values[:, 0]
    out = get_policy("vase-dkv").select(keys, values, None, K, generator=gen(0))
    assert torch.equal(out[:, 0], out[:, 1])
    # G entries are N(0, 1/r)
    G = get_policy("vase-dkv").draw_projection(400, D, gen(1), torch.device("cpu"))
    assert G.shape == (400, D, 20)
    assert abs(float(G.mean())) < 0.01
    assert abs(float(G.var()) - 1 / 20) < 0.003


def test_layer_state_hook_declares_curdkv_projection_only():
    gens = [gen(3), gen(4)]
    state = get_policy("curdkv").init_layer_state(2, HKV, D, gens, torch.device("cpu"))
    expected = get_policy("curdkv").draw_projection(2, D, [gen(3), gen(4)], torch.device("cpu"))
    assert list(state) == ["projection"] and torch.equal(state["projection"], expected)
    stateless = [name for name, cls in POLICIES.items()
                 if name != "curdkv" and cls().init_layer_state(2, HKV, D, gens, torch.device("cpu"))]
    assert stateless == []
    assert {name for name, cls in POLICIES.items() if cls.slot_state} == {"h2o"}


# ---------------------------------------------------------------------------------------------
# VaSE-AttnV structure and the value guard
# ---------------------------------------------------------------------------------------------
def non_sink_top_ranges(values, bi, hi, count, sinks=SINKS):
    r = ref_value_range(values)[bi, hi]
    order = sorted(range(sinks, values.shape[2]), key=lambda i: -float(r[i]))
    return set(order[:count])


@pytest.mark.parametrize("budget,n_reserve", [(40, 10), (48, 12), (None, 5), (30, 8)])
def test_vase_attnv_structure(budget, n_reserve):
    assert n_reserve == round(0.25 * (budget if budget is not None else K))
    keys, values, queries = make_inputs(18)
    policy = get_policy("vase-attnv")
    assert policy.reserve_size(K, budget) == n_reserve
    out = policy.select(keys, values, queries, K, generator=gen(0), budget=budget)
    assert_valid(out, B, HKV, N, K)
    for bi in range(B):
        for hi in range(HKV):
            row = out[bi, hi].tolist()
            assert row[:SINKS] == list(range(SINKS))
            assert set(row[SINKS:n_reserve]) == non_sink_top_ranges(values, bi, hi, n_reserve - SINKS)
            rest = row[n_reserve:]
            assert len(set(rest)) == K - n_reserve
            assert not set(rest) & set(row[:n_reserve])


class _FixedAttnV(P.POLICIES["vase-attnv"]):
    """VaSE-AttnV with a hand-set score (weights passed as `weights=` [b|1, h|1, n])."""

    def score(self, keys, values, queries, generator=None, weights=None, **extra):
        return weights.expand(keys.shape[:3]).float()


def test_vase_attnv_reserves_exactly_round_quarter_budget():
    # the candidates ranked 7..12 by value range get attention weight 0: never sampled, so the
    # kept ones among the top-12 values are exactly the reserve (4 sinks + 6 for B=40)
    keys, values, queries = make_inputs(19, b=1, hkv=1)
    r = ref_value_range(values)[0, 0]
    order = sorted(range(SINKS, N), key=lambda i: -float(r[i]))
    weights = torch.rand(1, 1, N, generator=gen(2)) + 0.1
    weights[0, 0, order[6:12]] = 0.0
    for seed in range(5):
        out = _FixedAttnV().select(keys, values, queries, K, generator=gen(seed), budget=40, weights=weights)
        kept = set(out[0, 0].tolist())
        assert kept & set(order[:12]) == set(order[:6])
        assert set(range(SINKS)) <= kept


def test_vase_attnv_explicit_n_large():
    keys, values, queries = make_inputs(20)
    out = get_policy("vase-attnv", n_large=9).select(keys, values, queries, K, generator=gen(0), budget=400)
    for bi in range(B):
        for hi in range(HKV):
            assert set(out[bi, hi, SINKS:9].tolist()) == non_sink_top_ranges(values, bi, hi, 5)


@pytest.mark.parametrize("metric", ["l2", "var"])
def test_value_guard_metrics(metric):
    keys, values, queries = make_inputs(21)
    v = values.double()
    mag = v.pow(2).sum(-1).sqrt() if metric == "l2" else v.var(-1, unbiased=False)
    out = get_policy("snapkv-v", metric=metric).select(keys, values, queries, K, budget=40)
    assert_topk(out[..., :10], mag, 10)
    banned = [[out[bi, hi, :10].tolist() for hi in range(HKV)] for bi in range(B)]
    assert_topk(out[..., 10:], ref_attention(keys, queries), K - 10, exclude=banned)


INJECTED = [30, 31, 32]


def injected_inputs():
    keys, values, queries = low_attention_inputs(range(26, 39))
    values[:, :, INJECTED] = 0.0
    values[:, :, INJECTED, 0] = 50.0
    values[:, :, INJECTED, 1] = -50.0
    return keys, values, queries


def count_injected(out):
    return [[len(set(out[bi, hi].tolist()) & set(INJECTED)) for hi in range(HKV)] for bi in range(B)]


def test_value_guard_keeps_injected_outliers():
    keys, values, queries = injected_inputs()
    # precondition (the construction): the outliers are far outside the attention top-K
    s = ref_attention(keys, queries)
    for bi in range(B):
        for hi in range(HKV):
            top = set(s[bi, hi].topk(K).indices.tolist())
            assert not top & set(INJECTED)
            assert float(s[bi, hi, INJECTED].max()) < float(s[bi, hi].sort(descending=True).values[K]) / 3
    none, every = [[0] * HKV] * B, [[len(INJECTED)] * HKV] * B
    for seed in range(5):
        out = get_policy("vase-attnv").select(keys, values, queries, K, generator=gen(seed), budget=40)
        assert count_injected(out) == every
    assert count_injected(get_policy("snapkv-v").select(keys, values, queries, K, budget=40)) == every
    assert count_injected(get_policy("evict-large-v").select(keys, values, queries, K)) == none
    assert count_injected(get_policy("snapkv").select(keys, values, queries, K)) == none
    for seed in range(3):
        out = get_policy("snapkv-sample").select(keys, values, queries, K, generator=gen(seed))
        assert sum(map(sum, count_injected(out))) <= 2  # tiny attention: rarely sampled


# ---------------------------------------------------------------------------------------------
# stochastic policies
# ---------------------------------------------------------------------------------------------
STOCHASTIC = [("vase-attnv", {}), ("snapkv-sample", {}), ("random", {}), ("vase-dkv", {}),
              ("tova", {"value_guard": 0.25, "sample": True})]


@pytest.mark.parametrize("name,params", STOCHASTIC)
def test_stochastic_seeded(name, params):
    keys, values, queries = make_inputs(22)
    policy = get_policy(name, **params)
    assert policy.stochastic
    a = policy.select(keys, values, queries, K, generator=gen(1), budget=40)
    b = policy.select(keys, values, queries, K, generator=gen(1), budget=40)
    c = policy.select(keys, values, queries, K, generator=gen(2), budget=40)
    assert_valid(a, B, HKV, N, K)
    assert torch.equal(a, b)
    assert not torch.equal(a.sort(-1).values, c.sort(-1).values)


@pytest.mark.parametrize("name,params", STOCHASTIC)
def test_stochastic_per_row_generators(name, params):
    keys, values, queries = make_inputs(23)
    policy = get_policy(name, **params)
    both = policy.select(keys, values, queries, K, generator=[gen(10), gen(11)], budget=40)
    for r, seed in enumerate([10, 11]):
        sl = slice(r, r + 1)
        single = policy.select(keys[sl], values[sl], queries[sl], K, generator=gen(seed), budget=40)
        assert torch.equal(both[sl], single)
        single_list = policy.select(keys[sl], values[sl], queries[sl], K, generator=[gen(seed)], budget=40)
        assert torch.equal(both[sl], single_list)
    # a row's choice does not depend on the other rows
    keys2 = keys.clone()
    keys2[1] = torch.randn_like(keys2[1])
    other = policy.select(keys2, values, queries, K, generator=[gen(10), gen(12)], budget=40)
    assert torch.equal(both[0], other[0])


def test_sampling_frequencies_k1():
    w = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03, 0.0])
    T = 20000
    idx = sample_without_replacement(w.expand(T, -1).clone(), 1, gen(0))
    assert idx.shape == (T, 1)
    freq = torch.bincount(idx[:, 0], minlength=len(w)).double() / T
    p = w.double() / w.sum()
    se = (p * (1 - p) / T).sqrt().clamp(min=1e-9)
    assert ((freq - p).abs() <= 4 * se + 1e-12).all(), (freq, p)
    assert freq[-1] == 0  # zero weight never drawn


def test_sampling_inclusion_k2_sequential_formula():
    w = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    p = w / w.sum()
    # P(i in S) for two sequential draws from the renormalised remainder
    incl = [float(p[i]) + sum(float(p[j]) * float(p[i]) / (1 - float(p[j])) for j in range(len(p)) if j != i)
            for i in range(len(p))]
    T = 20000
    idx = sample_without_replacement(w.float().expand(T, -1).clone(), 2, gen(1))
    assert (idx[:, 0] != idx[:, 1]).all()
    for i, q in enumerate(incl):
        emp = float((idx == i).any(-1).double().mean())
        assert abs(emp - q) <= 4 * math.sqrt(q * (1 - q) / T), (i, emp, q)


def test_sampling_excluded_never_drawn():
    w = torch.tensor([float("-inf"), 0.5, float("-inf"), 0.2, 0.3])
    idx = sample_without_replacement(w.expand(2000, -1).clone(), 3, gen(2))
    assert set(idx.flatten().tolist()) == {1, 3, 4}


def test_policy_sampling_frequencies_after_reserve():
    # VaSE-AttnV steps 4-5: reserved candidates get s=0, the rest is drawn proportional to s
    T, n = 20000, 8
    g = gen(3)
    keys = torch.randn(1, 1, n, D, generator=g).expand(1, T, n, D)
    values = torch.randn(1, 1, n, D, generator=g)
    values[0, 0, 5] *= 20  # the largest range among non-sinks
    values = values.expand(1, T, n, D)
    weights = torch.tensor([0.3, 0.1, 0.2, 0.05, 0.15, 0.1, 0.05, 0.05]).view(1, 1, n)
    policy = _FixedAttnV(sinks=2, n_large=3)
    queries = torch.zeros(1, T, 1, D)  # unused by the fixed score, required by the shape check
    out = policy.select(keys, values, queries, 4, generator=gen(4), weights=weights)
    assert (out[0, :, :2] == torch.tensor([0, 1])).all() and (out[0, :, 2] == 5).all()
    drawn = out[0, :, 3]
    p = weights[0, 0].double().clone()
    p[[0, 1, 5]] = 0
    p /= p.sum()
    freq = torch.bincount(drawn, minlength=n).double() / T
    se = (p * (1 - p) / T).sqrt()
    assert ((freq - p).abs() <= 4 * se + 1e-12).all(), (freq, p)


def test_random_uniform_inclusion():
    T, n, k = 4000, 10, 3
    keys = torch.zeros(1, T, n, D)
    out = get_policy("random").select(keys, keys, None, k, generator=gen(5))
    incl = torch.zeros(n)
    for i in range(n):
        incl[i] = (out == i).any(-1).float().mean()
    q = k / n
    assert ((incl - q).abs() <= 4 * math.sqrt(q * (1 - q) / T)).all(), incl


# ---------------------------------------------------------------------------------------------
# modifiers compose
# ---------------------------------------------------------------------------------------------
def test_tova_with_value_guard_and_sampling():
    keys, values, queries = make_inputs(24)
    policy = get_policy("tova", value_guard=0.25, sample=True)
    assert not policy.protect_sinks
    runs = [policy.select(keys, values, queries, K, generator=gen(s), budget=40) for s in range(4)]
    rests = set()
    for out in runs:
        assert_valid(out, B, HKV, N, K)
        for bi in range(B):
            for hi in range(HKV):
                assert set(out[bi, hi, :10].tolist()) == non_sink_top_ranges(values, bi, hi, 10, sinks=0)
                assert not set(out[bi, hi, 10:].tolist()) & set(out[bi, hi, :10].tolist())
        rests.add(tuple(out[..., 10:].sort(-1).values.flatten().tolist()))
    assert len(rests) > 1  # the rest is sampled
    # deterministic variant: reserve then the top TOVA scores among the others
    det = get_policy("tova", value_guard=0.25).select(keys, values, queries, K, budget=40)
    assert torch.equal(det[..., :10].sort(-1).values, runs[0][..., :10].sort(-1).values)
    banned = [[det[bi, hi, :10].tolist() for hi in range(HKV)] for bi in range(B)]
    assert_topk(det[..., 10:], ref_attention(keys, queries, kernel=1, last_only=True), K - 10, exclude=banned)


def test_snapkv_protect_sinks():
    keys, values, queries = low_attention_inputs(range(0, 8))
    s = ref_attention(keys, queries)
    plain = get_policy("snapkv").select(keys, values, queries, K)
    assert not (plain < SINKS).any()  # precondition: plain SnapKV drops the sinks here
    out = get_policy("snapkv", protect_sinks=True).select(keys, values, queries, K)
    assert_valid(out, B, HKV, N, K)
    assert (out[..., :SINKS] == torch.arange(SINKS)).all()
    banned = [[list(range(SINKS))] * HKV] * B
    assert_topk(out[..., SINKS:], s, K - SINKS, exclude=banned)


def test_get_policy_from_instance_and_params():
    p = get_policy("vase-attnv")
    assert p.params()["value_guard"] == 0.25 and p.protect_sinks and p.sample and p.sinks == 4
    q = get_policy(p, sinks=2)
    assert q.sinks == 2 and q.name == "vase-attnv"
    assert get_policy("VaSE_AttnV").name == "vase-attnv"


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_unknown_method_suggests_close_name():
    with pytest.raises(UnknownMethodError, match="snapkv"):
        get_policy("snapk")
    with pytest.raises(ValueError):
        get_policy("no-such-method-xyz")


def test_unknown_parameter_lists_accepted():
    with pytest.raises(UnknownMethodError) as e:
        get_policy("snapkv", window=3)
    msg = str(e.value)
    assert "window" in msg
    for accepted in ("temperature", "smooth_kernel", "value_guard", "sinks"):
        assert accepted in msg


def test_bad_select_inputs():
    keys, values, queries = make_inputs(25)
    snap = get_policy("snapkv")
    with pytest.raises(ValueError, match="n_keep"):
        snap.select(keys, values, queries, N + 1)
    with pytest.raises(ValueError, match="n_keep"):
        snap.select(keys, values, queries, 0)
    with pytest.raises(ValueError):
        snap.select(keys, values[:, :, :-1], queries, K)
    with pytest.raises(ValueError):
        snap.select(keys[0], values[0], queries, K)
    with pytest.raises(ValueError):
        snap.select(keys, values, queries[:, :3], K)  # 3 query heads for 2 KV heads
    with pytest.raises(ValueError):
        snap.select(keys, values, queries[..., :4], K)  # head_dim mismatch
    for name in ("snapkv", "rkv", "tova", "h2o", "vase-attnv", "snapkv-sample", "snapkv-v"):
        with pytest.raises(ValueError, match="quer"):
            get_policy(name).select(keys, values, None, K, generator=gen(0))
    with pytest.raises(ValueError, match="generator"):
        get_policy("random").select(keys, values, None, K, generator=[gen(0)])
    with pytest.raises(ValueError, match="projection"):
        get_policy("curdkv").select(keys, values, None, K, projection=torch.randn(B, D, 7))


@pytest.mark.parametrize("params", [
    {"metric": "l1"}, {"smooth_kernel": 4}, {"smooth_kernel": 0}, {"temperature": 0.0},
    {"value_guard": -0.1}, {"value_guard": 1.0}, {"value_guard": 1.5}, {"sinks": -1}, {"n_large": -2},
])
def test_bad_parameters(params):
    with pytest.raises(ValueError):
        get_policy("vase-attnv", **params)


def test_bad_parameters_other():
    with pytest.raises(ValueError):
        get_policy("rkv", rkv_lambda=1.5)
    with pytest.raises(ValueError):
        get_policy("curdkv", rank=0)


# ---------------------------------------------------------------------------------------------
# every evicting policy: valid, duplicate-free indices
# ---------------------------------------------------------------------------------------------
EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]


def _cases():
    # k < sinks included: protected sinks must be clamped to n_keep, never overflow it.
    for name in EVICTING:
        for k in (N, K, 5, 3, 1):
            yield pytest.param(name, k, id=f"{name}-{k}")


@pytest.mark.parametrize("name,k", list(_cases()))
def test_select_valid_for_every_policy(name, k):
    keys, values, queries = make_inputs(26)
    policy = get_policy(name)
    extra = {"accumulated": torch.zeros(B, HKV, N)} if "accumulated" in policy.slot_state else {}
    for budget in (None, 40, 4 * N):
        out = policy.select(keys, values, queries, k, generator=gen(0), budget=budget, **extra)
        assert_valid(out, B, HKV, N, k)


def test_full_never_evicts():
    assert not POLICIES["full"].evicts
    assert "full" in P.method_names()


def test_policies_and_schedule_import_without_transformers():
    """An engine can use the policy layer with torch alone: nothing on this path imports transformers."""
    import subprocess
    import sys

    code = ("import sys; import vase.core.policies, vase.core.schedule; from vase.core.policies import get_policy; "
            "get_policy('vase-attnv'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'); "
            "assert not bad, bad; import vase; vase.EvictionCache; assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_equal_scores_keep_the_lower_slot():
    # torch.topk orders exact ties as its kernel likes (CPU and CUDA differ), so a repeated token's equal value
    # rows in layer 0 kept different slots on different devices; the selection ranks ties by slot instead.
    scores = torch.tensor([[[0.5, 1.0, 0.2, 1.0, 1.0, 0.1, 1.0, 1.0]]])
    assert P.base.top_k_indices(scores, 3).tolist() == [[[1, 3, 4]]]
    ones = torch.ones(1, 1, 40)
    assert P.base.top_k_indices(ones, 5).tolist() == [[[0, 1, 2, 3, 4]]]


def test_value_guard_ties_keep_the_lower_slots():
    # Every value row equal: the value guard (snapkv-v's reserve) must keep the first slots, on any device.
    torch.manual_seed(0)
    n, d = 24, 8
    keys = torch.randn(1, 1, n, d)
    values = torch.ones(1, 1, n, d)
    queries = torch.randn(1, 1, 4, d)
    policy = get_policy("snapkv-v", n_large=6)
    kept = policy.select(keys, values, queries, n_keep=10)
    assert kept[0, 0, :6].tolist() == [0, 1, 2, 3, 4, 5]
