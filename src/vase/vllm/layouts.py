"""The paged KV cache as vLLM 0.32's attention backends store it, seen as vase's logical views.

Every GPU backend vase runs on (FlashAttention, FlashInfer, Triton attention) binds each
attention layer to one tensor of logical shape [num_blocks, kv_heads, block_size, 2 * head_dim]
(keys in the first `head_dim` channels, values in the rest); its memory order is the resolved
`KVCacheLayout` (LBNHC by default on Hopper, LBHNC for FlashInfer on Blackwell, any of the six
with `VLLM_KV_CACHE_LAYOUT`). The kernels unpack that tensor themselves (FlashAttention and
Triton: `kv_cache.transpose(1, 2).split(head_size, -1)`; FlashInfer:
`kv_cache.permute(*layout.layer_view_order).split(head_size, -1)`), all views of the same
bytes. `split_kv` cuts the same two views without assuming a memory order, so
`vase.vllm.paged.evict_paged` writes exactly the elements the kernels read.

vLLM's CPU kernel reinterprets its [num_blocks, kv_heads, block_size, 2 * head_dim] tensor as
packed blocks instead (`vase.vllm.worker.cpu_kernel_layout`): that is the packed `Layout` path.

No vLLM import: the tests run it on tensors strided as vLLM allocates them.
"""

from __future__ import annotations

import torch

from .config import VaseConfigError

#: vLLM attention implementation class -> backend name, for the backends the GPU worker was written for.
GPU_IMPLS = {
    "FlashAttentionImpl": "FLASH_ATTN",
    "FlashInferImpl": "FLASHINFER",
    "TritonAttentionImpl": "TRITON_ATTN",
}
#: Backend names (vLLM's `attention_config.backend`) the GPU worker accepts.
GPU_BACKENDS = tuple(GPU_IMPLS.values())


def split_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache [num_blocks, kv_heads, block_size, 2 * head_size] (any memory order) as key and value views.

    Returns two [num_blocks, kv_heads, block_size, head_size] views of the same storage (slices,
    no copy, no reshape)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise VaseConfigError(f"vase expects vLLM's [num_blocks, kv_heads, block_size, 2 * head_size] KV cache per "
                              f"layer (head_size {head_size}), got shape {tuple(kv_cache.shape)}: use vLLM 0.32 with "
                              f"an unquantised KV cache")
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def backend_of(impl: object) -> str:
    """The backend name of a GPU attention implementation vase supports; refuses any other in one line."""
    name = type(impl).__name__
    for cls in type(impl).__mro__:
        if cls.__name__ in GPU_IMPLS:
            return GPU_IMPLS[cls.__name__]
    raise VaseConfigError(f"vase's GPU worker runs on FlashAttention, FlashInfer or Triton attention, this layer uses "
                          f"{name}: set attention_config={{'backend': 'FLASH_ATTN'}} (MLA and other backends are "
                          f"not supported)")
