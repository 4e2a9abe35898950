"""A run's identity: what was run (settings, problems, methods, model and runtime) as one JSON object, its hash
and the run folder's name; and reading a finished run folder's config and records back."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vase.core.capabilities import ENGINES
from vase.eval.config import FULL, ConfigError, EvalConfig, MethodSpec, jsonable
from vase.eval.config_files import load_config
from vase.storage.registry import kind_of

__all__ = ["identity", "identity_hash", "identity_changes", "records_of_run", "read_run_config",
           "runtime_identity", "RUNTIME_FIELDS", "problems_digest", "run_name"]


def problems_digest(problems: Sequence[Any]) -> str:
    """sha256 over the problems' ids, tasks, questions and gold answers (the data identity)."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.id, p.task, p.question, p.answer], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def _load_problems(config: EvalConfig) -> list[Any]:
    from vase.eval.tasks import load_task

    return load_task(config.task_name, data_dir=config.data_dir, task_file=config.task_file,
                     question_field=config.question_field, answer_field=config.answer_field,
                     limit=config.limit, seed=config.seed)


def identity(config: EvalConfig, problems: Sequence[Any] | None = None) -> dict[str, Any]:
    """Everything that changes results, as plain JSON (loads the task when ``problems`` is None)."""
    if problems is None:
        problems = _load_problems(config)
    specs = config.method_specs()
    return {
        "task": config.task_name,
        "data": problems_digest(problems),
        "n_problems": len(problems),
        "limit": config.limit,
        "seed": config.seed,
        # Sorted: the order methods and budgets are listed in changes no result.
        "methods": {label: _method_identity(s) for label, s in sorted(specs.items())},
        "budgets": sorted(config.budgets),
        "window": config.window,
        "samples": config.samples,
        "max_new_tokens": config.max_new_tokens,
        "sampling": {"greedy": config.greedy, "temperature": float(config.temperature),
                     "top_p": float(config.top_p), "top_k": config.top_k},
        "chat_template": config.chat_template,
        "grading": {"numeric_fallback": config.numeric_fallback, "end_marker": config.end_marker},
        "model": config.model if config.model is not None else "default",
        "dtype": str(config.dtype),
        "engine": config.engine,
    }


def _method_identity(spec: MethodSpec) -> dict[str, Any]:
    """A method's part of the identity: its method, full parameters and (when not dense) its storage, so a
    ``kv_bits=4`` run never shares a folder with the dense run of the same settings. Dense adds no key, so the
    names of dense runs made before storage entered the identity stay the same."""
    out = {"method": spec.method, "params": jsonable(spec.policy.params())}
    if spec.storage is not None:
        out["storage"] = {"kind": kind_of(spec.storage).name, **jsonable(spec.storage.options())}
    return out


#: Identity fields found from the environment rather than typed by the user. They do not enter the run
#: name, so a resume under another model, dtype, device, kernel or library version finds the same
#: folder and is refused naming the field (instead of silently mixing two setups in one run).
RUNTIME_FIELDS: tuple[str, ...] = ("model_sha256", "resolved_dtype", "device", "attn_kernel", "torch",
                                   "transformers")


def runtime_identity(config: EvalConfig, model: Any = None) -> dict[str, Any]:
    """What besides the settings determines the outputs: the model's content hash (config, weights and
    tokenizer files, see :func:`vase.models.model_fingerprint`; a passed model object is hashed tensor by
    tensor), the resolved dtype, the device type, the attention kernel, and the torch and transformers
    versions. Reads no weights into a model (file hashes are memoised after the first time)."""
    import torch
    import transformers

    from vase.models import loaded_model_fingerprint, model_fingerprint, resolve_device, resolve_dtype

    if model is not None:
        param = next(model.parameters())
        kernel = str(getattr(model.config, "_attn_implementation", None) or config.attn_implementation)
        sha, dtype, device = loaded_model_fingerprint(model), param.dtype, param.device
        kernel = kernel.removeprefix("vase_")  # vase's wrapper around the stock kernel
    else:
        device = resolve_device(config.device)
        sha, dtype, kernel = model_fingerprint(config.model), resolve_dtype(config.dtype, device), \
            config.attn_implementation
    engine = ENGINES[getattr(config, "engine", "transformers")]
    if not engine.attn:  # an engine with its own kernels resolves dtype and kernel itself
        dtype, kernel = config.dtype, config.engine
    runtime = {"model_sha256": sha, "resolved_dtype": str(dtype).removeprefix("torch."), "device": device.type,
               "attn_kernel": kernel, "torch": torch.__version__, "transformers": transformers.__version__}
    if engine.version is not None:  # its kernels and scheduler produce the tokens: its version is part of the run
        from vase.core.capabilities import load_hook

        runtime[engine.name] = load_hook(engine.version)()
    return runtime


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's ``config.json`` as a dict; None when the folder has none. ConfigError (one line naming the file)
    when it is there but not a JSON object: the task, model and settings of every page and table come from it."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ConfigError(f"{path} is not valid JSON{where}: it holds the run's settings (vase eval writes it); "
                          f"restore it from a copy, or rerun the command that made the run") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} holds {type(meta).__name__}, not the run's settings (a JSON object): restore it "
                          f"from a copy, or rerun the command that made the run")
    return meta


def records_of_run(run_dir: str | Path, kind: str = "samples") -> list[dict[str, Any]]:
    """Every record of a run (:func:`vase.eval.store.read_all`) that belongs to it by its ``config.json``: a
    method and budget of the run, one of its problems, a sample below its count. Records that do not (appended
    by hand, copied from another run) are left out with one warning naming how many, so a summary never
    counts them. Without a readable config.json every record is kept."""
    import warnings

    from vase.eval.store import read_all

    records = read_all(run_dir, kind)
    try:
        meta = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        ident = meta["identity"]
        methods, budgets = set(ident["methods"]), set(ident["budgets"])
        n_problems, samples = int(ident["n_problems"]), int(ident["samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return records
    ids = _problem_ids(meta.get("config"), ident)

    def belongs(r: dict[str, Any]) -> bool:
        if r.get("method") not in methods:
            return False
        if not (r.get("budget") in budgets or (r.get("method") == FULL and r.get("budget") is None)):
            return False
        if ids is not None and r.get("problem_id") not in ids:
            return False
        index = r.get("problem_index")
        if index is not None and not (isinstance(index, int) and 0 <= index < n_problems):
            return False
        sample = r.get("sample")
        return kind != "samples" or (isinstance(sample, int) and 0 <= sample < samples)

    kept = [r for r in records if belongs(r)]
    if len(kept) < len(records):
        warnings.warn(f"{run_dir}: left out {len(records) - len(kept)} {kind} record(s) that are not part of this "
                      f"run (a method, budget, problem or sample its config.json does not hold)", stacklevel=2)
    return kept


def _problem_ids(saved: Any, ident: Mapping[str, Any]) -> set[str] | None:
    """The run's problem ids, from the task its config.json names (None when it cannot be loaded, or when the
    problems loaded now are not the ones the run saw)."""
    if not isinstance(saved, Mapping):
        return None
    try:
        problems = _load_problems(load_config(None, {k: v for k, v in saved.items()
                                                     if k in {f.name for f in dataclasses.fields(EvalConfig)}}))
    except Exception:  # noqa: BLE001 - a moved data file: fall back to the index and sample checks
        return None
    if problems_digest(problems) != ident.get("data"):
        return None
    return {p.id for p in problems}


def identity_changes(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The settings that differ between two identities, one ``dotted.path: old -> new`` each (leaves only, so a
    changed parameter reads ``methods.snapkv.params.sinks: 4 -> 2`` rather than two whole method tables)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{path}: (none) -> {_short(new[k])}")
            elif k not in new:
                out.append(f"{path}: {_short(old[k])} -> (none)")
            elif old[k] != new[k]:
                out.extend(identity_changes(old[k], new[k], path))
        return out
    return [] if old == new else [f"{prefix or 'identity'}: {_short(old)} -> {_short(new)}"]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def identity_hash(ident: Mapping[str, Any]) -> str:
    blob = json.dumps(ident, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "task"


def run_name(config: EvalConfig, problems: Sequence[Any] | None = None) -> str:
    """``<task>-n<problems>-s<samples>-<hash8>``; ``config.name`` when set.

    Deterministic: the same settings (and data) always give the same name, so rerunning a
    command resumes its run. Loads the task when ``problems`` is None.
    """
    if config.name:
        return config.name
    ident = identity(config, problems)
    return f"{_slug(config.task_name)}-n{ident['n_problems']}-s{config.samples}-{identity_hash(ident)[:8]}"
