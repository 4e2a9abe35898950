"""vase inside vLLM 0.32: config (`VaseVllmConfig`, `additional_config`) and per-request stats (`request_stats`) are ready; the plugin (`vase.vllm.plugin`) is work in progress.

Importing this package does not import vLLM; vLLM loads `vase.vllm.plugin:register` through
its `vllm.general_plugins` entry point, and nothing changes unless `additional_config` has a
"vase" section.
"""

from .config import CONFIG_KEY, VaseConfigError, VaseVllmConfig, additional_config
from .stats import RequestStats, max_blocks, request_stats, summarize

__all__ = ["CONFIG_KEY", "RequestStats", "VaseConfigError", "VaseVllmConfig", "additional_config", "max_blocks",
           "request_stats", "summarize"]
