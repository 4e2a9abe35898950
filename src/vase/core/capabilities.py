"""Which engines exist and what each can do: the flags eval, bench, generate and the CLI read instead of
comparing engine names.

    info = engine_info("vllm")        # SpecError naming the known engines for another name
    info.storage                      # False: vLLM keeps K/V in its own paged cache, in full precision
    refuse_unsupported("vllm", storage=True)   # SpecError: one line naming the setting and the fix

A new engine (SGLang, say) is one module implementing `vase.engines.Engine` plus one entry here
(`register_engine(EngineInfo(...))` from outside the package). Pure data: no torch, no transformers, no vLLM.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .errors import SpecError

__all__ = ["EngineInfo", "ENGINES", "engine_info", "engine_names", "refuse_unsupported", "engine_class",
           "register_engine", "load_hook"]


@dataclass(frozen=True)
class EngineInfo:
    """One engine and its capabilities."""

    name: str
    #: its `Engine` class, or where it lives ("module:Class", imported when first used)
    engine_class: str | type
    #: teacher forcing through the evicting cache (`forced_log_probs`; the eval's fidelity)
    forcing: bool
    #: schedules every pending prompt of one (method, budget) itself (one call), instead of vase's batches
    internal_batching: bool
    #: the class loads its own model from a name, ``Class(model, dtype=, device=, seed=)``; otherwise vase loads the
    #: transformers model and the class wraps it, ``Class(model, tokenizer)``
    loads_model: bool
    #: quantized K/V storage (`kv_bits`, `quant_guard`, ...)
    storage: bool
    #: a torch.compile'd decode step (`compile=True`, `--compile`)
    compile: bool
    #: takes vase's attention kernel choice (`--attn`); an engine with its own kernels does not
    attn: bool
    #: streams text while it decodes (its `generate` takes ``stream=``); otherwise `vase generate` prints each text
    #: when its batch is done
    streaming: bool
    #: "module:function" running `vase bench --engine <name>` itself (`bench(settings, given, log)`, see
    #: `vase.bench.vllm_bench.cli_bench`); None: vase's own decode bench (`vase.bench.runner`)
    bench: str | None = None
    #: "module:function" returning the engine's version string, recorded in a run's runtime under its name (its
    #: kernels and scheduler produce the tokens); None: nothing beyond torch and transformers
    version: str | None = None


ENGINES: dict[str, EngineInfo] = {e.name: e for e in (
    EngineInfo("transformers", "vase.engines.transformers:TransformersEngine", forcing=True, internal_batching=False,
               loads_model=False, storage=True, compile=True, attn=True, streaming=True),
    EngineInfo("vllm", "vase.engines.vllm:VllmEngine", forcing=False, internal_batching=True, loads_model=True,
               storage=False, compile=False, attn=False, streaming=False, bench="vase.bench.vllm_bench:engine_bench",
               version="vase.engines.vllm:vllm_version"),
)}


def register_engine(info: EngineInfo) -> None:
    """Add `info` to the engines every door reads (`--engine`, eval's ``engine``, the request spec's checks);
    SpecError, one line, for a name already taken."""
    if not isinstance(info, EngineInfo):
        raise SpecError(f"register_engine takes an EngineInfo, got {type(info).__name__}")
    if info.name in ENGINES:
        raise SpecError(f"engine {info.name!r} is already registered: pick another name")
    ENGINES[info.name] = info


def engine_names() -> list[str]:
    return list(ENGINES)


def engine_info(name: Any) -> EngineInfo:
    """The registered engine `name`; SpecError naming the known ones otherwise."""
    if isinstance(name, str) and name in ENGINES:
        return ENGINES[name]
    raise SpecError(f"unknown engine {name!r}: use {' or '.join(ENGINES)}")


def engine_class(name: str) -> type:
    """The engine's `Engine` class (imports its module: vLLM's engine imports vLLM only when started)."""
    where = engine_info(name).engine_class
    return where if isinstance(where, type) else load_hook(where)


def load_hook(where: str) -> Any:
    """The object a "module:name" entry names (an engine class, its bench, its version function)."""
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


#: capability -> (what the user asked for, how to drop it)
_ASKED = {
    "storage": ("quantized K/V storage (kv_bits)", "drop --kv-bits/--quant-guard (kv_bits, quant_guard)"),
    "compile": ("a compiled decode step (compile)", "drop --compile"),
    "attn": ("an attention kernel choice (--attn)", "drop --attn (the engine picks its own kernels)"),
    "forcing": ("teacher forcing (fidelity)", "drop --fidelity"),
}


def refuse_unsupported(engine: str, **asked: bool) -> None:
    """SpecError, one line, for the first capability in `asked` (e.g. ``storage=True``) that `engine` lacks."""
    info = engine_info(engine)
    for capability, wanted in asked.items():
        if wanted and not getattr(info, capability):
            what, drop = _ASKED[capability]
            able = [e.name for e in ENGINES.values() if getattr(e, capability)]
            raise SpecError(f"{what} runs on the {' or '.join(able)} engine only, not on {info.name}: {drop}, or use "
                            f"--engine {able[0]}")
