"""Whether vLLM can import a model's code, asked before an engine or server starts.

vLLM inspects a model's architecture in a subprocess and, when its module cannot be imported (Qwen3.5's code
imports torchvision through Qwen3-VL), logs a 55-line traceback and raises "1 validation error for ModelConfig",
which names no cause. Importing the architecture's module here first turns that into one line naming what is
missing. Only vLLM's own registry is read (``vllm.ModelRegistry``); nothing is patched.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["architecture_problem", "validation_line"]


def _architectures(model_path: str) -> list[str]:
    """The ``architectures`` of the model folder's config.json ([] when it cannot be read: vLLM says why)."""
    try:
        from transformers import AutoConfig

        return list(getattr(AutoConfig.from_pretrained(model_path), "architectures", None) or [])
    except Exception:  # noqa: BLE001 - a config vLLM cannot read either: its own message is clearer
        return []


def architecture_problem(model_path: str) -> str | None:
    """One line when vLLM cannot import the code of the model at `model_path` (None: it can, or vLLM does not
    know the architecture and says so itself)."""
    from vllm import ModelRegistry

    for arch in _architectures(model_path):
        module = getattr(ModelRegistry.models.get(arch), "module_name", None)  # a lazily registered model's module
        if not module:
            continue
        try:
            _quiet_import(module)
        except ImportError as exc:
            missing = (getattr(exc, "name", None) or "").split(".")[0]
            if isinstance(exc, ModuleNotFoundError) and missing and importlib.util.find_spec(missing) is None:
                return (f"vLLM cannot load {model_path} ({arch}): its model code ({module}) needs the package "
                        f"{missing!r}, which is not installed: pip install {missing}, or run it with "
                        f"--engine transformers")
            return f"vLLM cannot load {model_path} ({arch}): importing {module} failed: {_first_line(exc)}"
        except Exception as exc:  # noqa: BLE001 - any error in the model's module stops vLLM the same way
            return (f"vLLM cannot load {model_path} ({arch}): importing {module} failed: "
                    f"{type(exc).__name__}: {_first_line(exc)}")
        return None
    return None


def _quiet_import(module: str) -> None:
    """Import `module` with transformers' warnings held back (a model's code may warn about the very package whose
    absence is then reported in one line)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        importlib.import_module(module)
    finally:
        hf_logging.set_verbosity(level)


def validation_line(exc: BaseException) -> str | None:
    """The first reason of a pydantic ValidationError vLLM raises for its config (``Value error, ...``), as one
    line; None for any other exception."""
    errors: Any = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(errors):
        return None
    try:
        first = errors()[0]
    except Exception:  # noqa: BLE001 - not pydantic's shape after all
        return None
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "__root__")
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"vLLM refused its configuration{f' ({where})' if where else ''}: {_first_line(message)}"


def _first_line(value: Any) -> str:
    text = str(value).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 300 else line[:297] + "..."
