"""`vase serve`: vLLM's OpenAI-compatible server with the vase plugin (the work is :mod:`vase.vllm.serve`)."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from .common import ParamOpt, UserError, WindowOpt, checked_params, err_console

__all__ = ["serve"]


def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="Model directory, .gguf file or hub id (default: the "
                                                   "embedded SmolLM2-135M-Instruct).")] = None,
    method: Annotated[str, typer.Option(help="Eviction method (see `vase methods`); full = stock vLLM.")]
    = "vase-attnv",
    budget: Annotated[int, typer.Option(help="KV pairs kept per layer and KV head.")] = 2048,
    window: WindowOpt = 64,
    param: ParamOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for the server before saying what to check "
                                                 "(it keeps waiting; 0 = never say).")] = 300.0,
) -> None:
    """Serve MODEL with vLLM's OpenAI-compatible server and the vase plugin.

    Any further option goes to vLLM unchanged (e.g. --max-model-len 8192 --kv-cache-memory-bytes 2000000000).
    One line says when the server answers (URL, model, method, budget); start-up takes 1-2 minutes on a CPU.
    """
    from ..vllm.serve import exec_serve, require_vllm, run_serve, serve_argv

    # What `vase generate --engine vllm` checks, before vLLM starts: the request spec (method, parameters, budget,
    # window, reserves; no quantized storage on vLLM) and the server's own settings.
    params = checked_params([method], param, budgets=[budget], window=window, engine="vllm")
    if ready_timeout < 0:
        raise UserError(f"--ready-timeout must be >= 0 seconds, got {ready_timeout:g}")
    require_vllm()
    extra = list(ctx.args)
    if model is not None and model.startswith("-"):  # no MODEL given: the first vLLM option landed there
        model, extra = None, [model, *extra]
    from ..core.capabilities import refuse_unsupported

    # vase's own flags of other commands would reach vLLM as unknown options after its start-up: refuse them here
    asked = {flag.split("=")[0] for flag in extra}
    refuse_unsupported("vllm", storage=bool(asked & {"--kv-bits", "--quant-guard"}), compile="--compile" in asked,
                       attn="--attn" in asked)
    argv = serve_argv(model, method=method, budget=budget, window=window, params=params, host=host,
                      port=port, extra=extra)
    err_console.print(f"vase serve: {' '.join(argv[1:])}", highlight=False, soft_wrap=True)
    if os.environ.get("VASE_SERVE_EXEC") == "1":  # replace this process (no ready line), as before
        exec_serve(argv)
    code = run_serve(argv, ready_timeout)
    if code:
        raise typer.Exit(code)
