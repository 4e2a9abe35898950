"""Paged compaction in the GPU backends' cache layouts equals the dense EvictionLayer, for every evicting method.

vLLM 0.32 binds each attention layer to a [num_blocks, kv_heads, block_size, 2 * head_dim] view
of one shared buffer, strided by the resolved `KVCacheLayout` (six of them; FlashAttention and
Triton take any, LBNHC by default; FlashInfer on Blackwell LBHNC or BLHNC). The caches here are
built by vLLM's own `create_kv_cache_views` (CPU tensors, no kernel), two layers per buffer, and
read back through each backend's own unpacking (FlashAttention/Triton: transpose(1, 2) then
split; FlashInfer: permute(layer_view_order) then split) to check that the kernels would see
the compacted rows.
"""

import pytest
import torch

from vase.core import schedule
from vase.core.policies import get_policy
from vase.vllm.layouts import split_kv
from vase.vllm.paged import RequestPolicyState, evict_paged, gather, scatter, slot_index

from .test_vllm_paged import EVICTING, _dense_run

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

LAYOUTS = list(KVCacheLayout)


def vllm_layer_caches(layout, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32, kernel_block_size=None,
                      num_layers=2):
    """The per-layer caches vLLM's allocator builds (one int8 buffer, `create_kv_cache_views`), or None when vLLM
    refuses that kernel block split for this layout."""
    spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype)
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(spec, num_blocks, num_layers, layout)
    tensor = kvi.KVCacheTensor(size=spec.page_size_bytes * num_blocks * num_layers,
                               layers=[f"model.layers.{i}.self_attn.attn" for i in range(num_layers)],
                               layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    try:
        return raw, kvi.create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size)
    except ValueError:
        return raw, None


def kernel_views(backend: str, kv_cache: torch.Tensor, layout, head_dim: int):
    """(key, value) as the backend's forward unpacks them (vLLM 0.32 source), as [num_blocks, block_size, kv_heads, d]."""
    if backend in ("FLASH_ATTN", "TRITON_ATTN"):  # flash_attn.py / triton_attn.py forward
        return kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    permuted = kv_cache.permute(*layout.layer_view_order)  # flashinfer.py forward: "HND and contiguous"
    k, v = permuted.split(head_dim, dim=-1)
    # undo the permutation to compare in one order: [B, H, N, d] -> [B, N, H, d]
    inverse = [layout.layer_view_order.index(i) for i in range(4)]
    return k.permute(*inverse).transpose(1, 2), v.permute(*inverse).transpose(1, 2)


def test_split_kv_views_the_bytes_each_backend_kernel_reads():
    """A row written through vase's view is read back by every backend's own unpacking, in all six layouts."""
    for layout in LAYOUTS:
        raw, views = vllm_layer_caches(layout, num_blocks=6, block_size=4, kv_heads=2, head_dim=8)
        key, value = split_kv(views[1], 8)
        row = torch.arange(1.0, 17.0).view(2, 1, 8)
        scatter(key, None, torch.tensor([3]), torch.tensor([2]), row)
        scatter(value, None, torch.tensor([3]), torch.tensor([2]), -row)
        assert int((views[0] != 0).sum()) == 0  # the other layer is untouched
        for backend in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"):
            k, v = kernel_views(backend, views[1], layout, 8)
            assert torch.equal(k[3, 2], row[:, 0]) and torch.equal(v[3, 2], -row[:, 0]), (layout, backend)
            assert int((k != 0).sum()) == 16


def _paged_run_strided(method, K, V, Q, P, B, w, seed, layout, kernel_block_size=None, block_size=4, num_blocks=40):
    """`test_vllm_paged._paged_run` on layer 1 of a vLLM-allocated cache in `layout` (layer 0 holds a sentinel)."""
    policy = get_policy(method)
    _, h, n, d = K.shape
    raw, views = vllm_layer_caches(layout, num_blocks, block_size, h, d, kernel_block_size=kernel_block_size)
    if views is None:
        return None
    g = torch.Generator().manual_seed(0)
    views[0].copy_(torch.full_like(views[0], 7.0))
    views[1].copy_(torch.randn(views[1].shape, generator=g))  # garbage outside the request's slots
    key_cache, value_cache = split_kv(views[1], d)
    cbs = key_cache.shape[2]
    limit = schedule.first_limit(P, B, w)
    block_ids = torch.randperm(num_blocks, generator=g)[: -(-limit // block_size)]
    positions = torch.full((h, limit), -1, dtype=torch.long)
    state = RequestPolicyState(generator=torch.Generator().manual_seed(seed))
    length, snaps = 0, []
    for t in range(n):
        if t >= P and schedule.is_eviction_step(P, B, w, t - P):
            index = evict_paged(key_cache, value_cache, block_ids, length, Q[:, :, t - w:t], policy, B, w, state,
                                layer=0, block_size=block_size)
            positions[:, :B] = positions[torch.arange(h)[:, None], index[0]]
            length = B
            blocks, offsets = slot_index(block_ids, B, block_size, cbs)
            snaps.append((gather(key_cache, None, blocks, offsets), gather(value_cache, None, blocks, offsets),
                          positions[None, :, :B].clone()))
        blocks, offsets = slot_index(block_ids, length + 1, block_size, cbs)
        scatter(key_cache, None, blocks[-1:], offsets[-1:], K[0, :, t:t + 1])
        scatter(value_cache, None, blocks[-1:], offsets[-1:], V[0, :, t:t + 1])
        positions[:, length] = t
        length += 1
    assert bool((views[0] == 7.0).all())  # the other layer sharing the buffer was never written
    return snaps


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("method", EVICTING)
def test_strided_compaction_equals_dense_eviction(method, layout):
    torch.manual_seed(3)
    B, w, h, hq, d, P = 24, 8, 2, 4, 16, 37
    n = schedule.first_limit(P, B, w) + 2 * w + 2  # three evictions
    K, V, Q = torch.randn(1, h, n, d), torch.randn(1, h, n, d), torch.randn(1, hq, n, d)
    V[0, :, 5] *= 9.0
    dense = _dense_run(method, K, V, Q, P, B, w, seed=11)
    for kernel_block_size in (None, 2):  # 2: vLLM splits each 4-token block into two kernel blocks
        paged = _paged_run_strided(method, K, V, Q, P, B, w, 11, layout, kernel_block_size)
        if paged is None:
            # vLLM splits blocks only where a block is one dense page (the layer-outermost L?B layouts)
            assert kernel_block_size is not None and not layout.name.startswith("LB")
            continue
        assert len(dense) == len(paged) == 3
        for (dk, dv, dp), (pk, pv, pp) in zip(dense, paged):
            assert torch.equal(dp, pp)
            assert torch.equal(dk, pk) and torch.equal(dv, pv)


def test_the_views_are_strided_not_contiguous():
    """The layouts differ in memory order (the test above is not six copies of one case)."""
    strides = set()
    for layout in LAYOUTS:
        _, views = vllm_layer_caches(layout, num_blocks=6, block_size=4, kv_heads=2, head_dim=8)
        key, _ = split_kv(views[0], 8)
        strides.add(key.stride())
        assert not key.is_contiguous()
    assert len(strides) >= 4
