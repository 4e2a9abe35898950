"""Reading an eval config file (-c FILE: TOML, YAML or JSON; duplicate keys refused, dashes or underscores in
keys) and its command-line overrides into an :class:`~vase.eval.config.EvalConfig`."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vase.eval.config import ConfigError, EvalConfig, canonical_label
from vase.files.textfiles import decode_utf8

__all__ = ["load_config"]


def _read_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder: give the .toml, .yaml or .json file (-c FILE)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = decode_utf8(path.read_bytes(), f"config file {path}", "save it as UTF-8", ConfigError)
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python < 3.11
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = _yaml_unique(text) or {}
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_unique)
        else:
            raise ConfigError(f"config file {path} must end in .toml, .yaml, .yml or .json")
    except ConfigError:
        raise
    except _DuplicateKey as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any parser's error
        raise ConfigError(f"cannot read config file {path}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of settings, got {type(data).__name__}")
    # Allow the settings under an [eval] table (so one file can hold other sections too).
    if set(data) == {"eval"} and isinstance(data["eval"], dict):
        data = data["eval"]
    return data


class _DuplicateKey(ValueError):
    """A config key given twice (YAML and JSON keep the last silently; TOML refuses on its own)."""


def _json_unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"the key {k!r} is given twice: give it once")
        out[k] = v
    return out


def _yaml_unique(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKey(f"the key {key!r} is given twice (line {key_node.start_mark.line + 1}): give it "
                                    f"once")
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def _normalise_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in known:
            from vase.core.policies import POLICIES
            from vase.storage.registry import storage_keywords

            method_keys = set(storage_keywords()) | {f.name for cls in POLICIES.values()
                                                      for f in dataclasses.fields(cls)}
            if key in method_keys:  # a method's parameter or the storage, written at the top of the file
                raise ConfigError(f"{where}: {k!r} is a method's setting, not the run's: put it under method_params, "
                                  f"e.g. method_params: {{snapkv: {{{key}: {v!r}}}}} (or -p {key}={v} on the command "
                                  f"line, which applies it to every method that takes it)")
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown setting {k!r}{hint}")
        out[key] = v
    return out


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                **kwargs: Any) -> EvalConfig:
    """An EvalConfig from a TOML/YAML/JSON file, then ``overrides`` and keyword arguments on top.

    Override values that are None are ignored (a flag that was not given); others win over the
    file. ``method_params`` merges per method label. Keys may use dashes (``max-new-tokens``).
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = _normalise_keys(_read_file(Path(path).expanduser()), str(path))
    merged_over = {**(overrides or {}), **kwargs}
    over = _normalise_keys({k: v for k, v in merged_over.items() if v is not None}, "overrides")
    if "method_params" in over and "method_params" in data:
        mp = {canonical_label(k): dict(v) for k, v in (data["method_params"] or {}).items()}
        for k, v in over.pop("method_params").items():
            mp.setdefault(canonical_label(k), {}).update(v)
        data["method_params"] = mp
    data.update(over)
    try:
        return EvalConfig(**data)
    except TypeError as e:
        raise ConfigError(f"bad config: {e}") from e


# ----------------------------------------------------------------------------- identity
