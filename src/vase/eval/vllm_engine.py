"""Where the vLLM engine used to live: it is :mod:`vase.engines.vllm` now.

Kept only while ``vase.eval.config`` (the run's vLLM version, in ``runtime_identity``) imports
:func:`vllm_version` from here; delete this module once it imports from :mod:`vase.engines.vllm`.
"""

from __future__ import annotations

from vase.engines.vllm import vllm_available, vllm_version

__all__ = ["vllm_available", "vllm_version"]
