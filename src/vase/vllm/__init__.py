"""vase inside vLLM 0.32: config (`additional_config`), per-request stats (`request_stats`), and the plugin (scheduler, CPU worker, query capture, paged eviction); the GPU worker is built and unit-tested on CPU, not yet run on a GPU (docs/vllm-gpu.md).

Importing this package does not import vLLM; vLLM loads `vase.vllm.plugin:register` through
its `vllm.general_plugins` entry point, and nothing changes unless `additional_config` has a
"vase" section. See docs/vllm.md.
"""

from .config import CONFIG_KEY, VaseConfigError, VaseVllmConfig, additional_config
from .stats import RequestStats, max_blocks, request_stats, summarize

__all__ = ["CONFIG_KEY", "RequestStats", "VaseConfigError", "VaseVllmConfig", "additional_config", "max_blocks",
           "request_stats", "summarize"]
