"""Evaluation configuration: what to run, loaded from a YAML/TOML/JSON file plus overrides.

    cfg = load_config("eval.toml", {"limit": 6, "methods": "full,snapkv"})   # flags win
    name = run_name(cfg)            # "arith-n6-s1-3f2a9c1d": the same command, the same run dir

The run identity (:func:`identity`) holds everything that changes results: the problems
themselves (a digest of ids, questions and answers), the limit and seed, every method with its
*full* parameter set, budgets, window, samples, length cap, sampling, grading switches, model and
dtype. Things that must not change results (batch size, device, output folder, fidelity on/off,
progress) are left out, so changing them resumes the same run.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vase.core.capabilities import ENGINES
from vase.core.errors import SpecError
from vase.core.policies import Policy, UnknownMethodError, get_policy
from vase.core.scalars import plain, plain_items
from vase.storage.quantized import QuantSpec  # torch only: checking a config imports no transformers
from vase.storage.registry import spec_from_options
from vase.core.spec import INT_MAX, SEED_MAX, Request, RequestSpec, split_storage

__all__ = [
    "ConfigError",
    "EvalConfig",
    "MethodSpec",
    "FULL",
    "whole_number",
    "canonical_label",
]

#: The reference method; always run once per problem, recorded with ``budget = None``.
FULL = "full"

_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
_ATTN = ("sdpa", "eager", "flash_attention_2")


class ConfigError(ValueError):
    """An evaluation config that cannot run; the message says what to change."""


def canonical_label(name: str) -> str:
    """How a method label is normalised: ``"VaSE_AttnV "`` -> ``"vase-attnv"`` (as get_policy does)."""
    return str(name).strip().lower().replace("_", "-")


@dataclass(frozen=True)
class MethodSpec:
    """One method of a run: its label in records, the registered method, its policy parameters, its storage."""

    label: str
    method: str  # registered name passed to get_policy / generate
    params: dict[str, Any]  # the policy's parameters, only what the user set (passed on as keyword arguments)
    policy: Policy  # get_policy(method, **params): its params() are the full identity
    storage: QuantSpec | Any = None  # how the cache holds K/V: a registered spec (`vase.storage.registry`); None: dense

    @property
    def evicts(self) -> bool:
        return bool(self.policy.evicts)

    @property
    def cache_params(self) -> dict[str, Any]:
        """The keyword arguments `generate` / `forced_log_probs` pass to the cache: the policy's, and the storage."""
        return self.params if self.storage is None else {**self.params, "storage": self.storage}

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "params": jsonable(self.policy.params()), "repr": repr(self.policy)}


_SCALARS: dict[str, type] = {
    "limit": int, "seed": int, "window": int, "samples": int, "max_new_tokens": int, "batch_size": int,
    "top_k": int, "temperature": float, "top_p": float, "greedy": bool, "chat_template": bool,
    "numeric_fallback": bool, "fidelity": bool,
}


#: Settings that are text, and what each holds (a number or a list there is refused naming the setting).
_TEXT: dict[str, str] = {
    "task": "a task name", "data_dir": "a folder path", "task_file": "a file path", "question_field": "a field name",
    "answer_field": "a field name", "end_marker": "a string", "model": "a model spec (hub id, folder or .gguf)",
    "dtype": "a dtype name", "device": "a device name", "attn_implementation": "a kernel name",
    "engine": "an engine name", "output_dir": "a folder path", "name": "a folder name",
}

#: Integer settings torch must be able to hold (a larger budget or length overflows a C long deep inside torch).
_INT_MAX, _SEED_MAX = INT_MAX, SEED_MAX


def whole_number(name: str, value: Any, *, maximum: int = _INT_MAX) -> Any:
    """``value`` as an int when it is one (``32.0`` -> 32); ConfigError for a bool, a fraction or a number past
    ``maximum``. Anything else (None, a string) is returned as it is, for the caller's own check."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r} (a true/false value): write a number")
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    if isinstance(value, int) and abs(value) > maximum:
        raise ConfigError(f"{name} {value} is too {'small' if value < 0 else 'large'} (at "
                          f"{'least' if value < 0 else 'most'} {-maximum if value < 0 else maximum})")
    return value


def _parse_scalar(text: str, kind: type) -> Any:
    t = text.strip()
    if t.lower() in ("none", "null", ""):
        return None
    if kind is bool:
        if t.lower() in ("1", "true", "yes", "on"):
            return True
        if t.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(t)
    return kind(t)


def _split_list(value: Any) -> list[Any]:
    """``"a,b"`` or ``["a", "b"]`` or ``"a"`` -> a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (int, float)):
        return [value]
    return list(value)


@dataclass
class EvalConfig:
    """Everything an evaluation run needs.

    task: a task name (``arith``, ``arith-N``, ``gsm8k``, ``math500``, ...) or, with ``task_file``,
        a label (default: the file's stem). data_dir / task_file / question_field / answer_field /
        limit / seed: passed to :func:`vase.eval.tasks.load_task` (seed also seeds sampling).
    methods: method labels. A label is a registered method name, or any label whose entry in
        ``method_params`` names the method (``{"snapkv-v16": {"method": "snapkv-v", "n_large": 16}}``).
        ``full`` (the reference) is always run once, whether listed or not.
    budgets: KV budgets B, each run with every evicting method.
    samples: completions per problem (the paper's n for pass@1).
    batch_size: sequences per generate call (the samples of one problem stay together; several
        problems share a call when it allows). Does not change results.
    fidelity: also teacher-force the full cache's first sample through every method and record
        KL / top-1 agreement / delta-NLL. Does not change the sample records.
    model: a model spec for :func:`vase.models.load_model` (None = the embedded default).
    engine: ``transformers`` (vase's decode loop) or ``vllm`` (vLLM's ``LLM.generate`` with the vase
        plugin; no fidelity). Part of the identity: a run never mixes engines.
    name: the run folder's name under ``output_dir`` (default: :func:`run_name`).
    """

    task: str | None = None
    data_dir: str | None = None
    task_file: str | None = None
    question_field: str | None = None
    answer_field: str | None = None
    limit: int | None = None
    seed: int = 0
    methods: list[str] = field(default_factory=lambda: ["vase-attnv"])
    budgets: list[int] = field(default_factory=lambda: [512])
    window: int = 64
    samples: int = 1
    max_new_tokens: int = 2048
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int | None = None
    greedy: bool = False
    chat_template: bool = True
    numeric_fallback: bool = False
    end_marker: str | None = None
    batch_size: int = 8
    fidelity: bool = False
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attn_implementation: str = "sdpa"
    engine: str = "transformers"
    method_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    output_dir: str = "runs"
    name: str | None = None

    def __post_init__(self) -> None:
        self._coerce()
        self._validate()

    # -- normalisation ---------------------------------------------------------------------------
    def _coerce(self) -> None:
        # Strings from a command line or an environment become the field's type.
        for name, kind in _SCALARS.items():
            v = plain(getattr(self, name))  # np.int64(32) is 32 (vase.core.scalars)
            if isinstance(v, str):
                try:
                    v = _parse_scalar(v, kind)
                except ValueError as e:
                    raise ConfigError(f"{name} must be {kind.__name__}, got {v!r}") from e
            # Types before ranges: a bool is no count (samples = true), 8.9 is no window, 1 is no switch.
            if kind is int:
                v = whole_number(name, v, maximum=_SEED_MAX if name == "seed" else _INT_MAX)
                if v is not None and not isinstance(v, int):
                    raise ConfigError(f"{name} must be an integer, got {v!r}")
            elif kind is float and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"{name} must be a number, got {v!r}")
            elif kind is bool and v is not None and not isinstance(v, bool):
                raise ConfigError(f"{name} must be true or false, got {v!r}")
            setattr(self, name, v)
        if isinstance(self.methods, (list, tuple)) and any(not isinstance(m, str) for m in self.methods):
            raise ConfigError(f"methods must be method names, got {self.methods!r}")
        self.methods = [canonical_label(m) for m in _split_list(self.methods)]
        # 32.5 is no budget; the range (B <= 2**31 - 1) is the request spec's, checked per method in _validate
        budgets = [whole_number("budgets", plain(b), maximum=1 << 256) for b in _split_list(plain(self.budgets))]
        try:
            self.budgets = [int(b) for b in budgets]
        except (TypeError, ValueError) as e:
            raise ConfigError(f"budgets must be integers, got {self.budgets!r}") from e
        if self.method_params is None:
            self.method_params = {}
        if not isinstance(self.method_params, Mapping):
            raise ConfigError(f"method_params must map a method label to its parameters, got {self.method_params!r}")
        params: dict[str, dict[str, Any]] = {}
        for label, p in self.method_params.items():
            if not isinstance(p, Mapping):
                raise ConfigError(f"method_params[{label!r}] must be a table of parameters, got {p!r}")
            params[canonical_label(label)] = plain_items(p)
        self.method_params = params
        for name in ("task", "data_dir", "task_file", "model", "output_dir", "name"):
            v = getattr(self, name)
            if isinstance(v, Path):
                setattr(self, name, str(v))
        for name, what in _TEXT.items():  # `output_dir: 5` in a config: one line, not a TypeError deep in pathlib
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{name} must be {what}, got {v!r}: write it as text (in quotes)")

    @property
    def task_name(self) -> str:
        """The task label: ``task``, else the task file's stem, else ``arith``."""
        if self.task:
            return self.task
        if self.task_file:
            return Path(self.task_file).stem
        return "arith"

    # -- validation ------------------------------------------------------------------------------
    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(bool(self.methods), "methods is empty: name at least one method (e.g. --methods full,vase-attnv)")
        need(len(set(self.methods)) == len(self.methods), f"methods lists a method twice: {self.methods}")
        need(isinstance(self.samples, int) and self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        need(isinstance(self.batch_size, int) and self.batch_size >= 1,
             f"batch_size must be >= 1, got {self.batch_size}")
        need(self.limit is None or (isinstance(self.limit, int) and self.limit >= 1),
             f"limit must be >= 1 (or unset for every problem), got {self.limit}")
        need(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(self.greedy or float(self.temperature) > 0,
             f"temperature must be > 0 (or set greedy), got {self.temperature}")
        need(0 < float(self.top_p) <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
             f"top_k must be >= 1 or unset, got {self.top_k}")
        need(self.name is None or _one_component(self.name),
             f"name must be one folder name (no '/', '\\', '..' or leading '.'), got {self.name!r}: it names the "
             f"run folder inside output_dir")
        need(str(self.dtype) in _DTYPES, f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        need(self.engine in ENGINES, f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        forcing = [e for e, info in ENGINES.items() if info.forcing]
        need(not (self.fidelity and not ENGINES[self.engine].forcing),
             f"fidelity (teacher forcing) runs on the {' or '.join(forcing)} engine only, not on {self.engine!r}: drop "
             f"--fidelity or use --engine {forcing[0]}")
        need(self.attn_implementation in _ATTN,
             f"attn_implementation must be one of {', '.join(_ATTN)}, got {self.attn_implementation!r}")
        from vase.eval.tasks import check_task_sources
        from vase.eval.problems import TaskError

        try:  # a data folder or field name the task would not read: refused, not ignored
            check_task_sources(self.task_name, data_dir=self.data_dir, task_file=self.task_file,
                               question_field=self.question_field, answer_field=self.answer_field)
        except TaskError as e:
            raise ConfigError(str(e)) from None
        for label in self.method_params:
            if label not in self.methods:
                close = difflib.get_close_matches(label, self.methods, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"method_params names {label!r}, which is not in methods {self.methods}{hint}")
        specs = self.method_specs()  # raises on unknown methods / parameters
        evicting = [s for s in specs.values() if s.evicts]
        if evicting:
            need(bool(self.budgets), f"budgets is empty but {evicting[0].label!r} evicts: give --budgets")
        need(len(set(self.budgets)) == len(self.budgets), f"budgets lists a budget twice: {self.budgets}")
        # The one request check (budget rule, reserves, storage) of every method at every budget (no budget: the
        # methods that keep every token, at theirs).
        requests: dict[tuple[str, int | None], Request] = {}
        for b in self.budgets or [None]:
            for s in specs.values():
                requests[s.label, b] = self._validated(s, b)
        if (FULL, None) not in requests:  # the reference runs without a budget (its placeholder)
            requests[FULL, None] = self._validated(specs[FULL], None)
        object.__setattr__(self, "_requests", requests)  # not a field: no part of to_dict, equality or identity

    def _validated(self, s: MethodSpec, budget: int | None) -> Request:
        """The one request check of method `s` at `budget` (ConfigError naming the method)."""
        try:
            return RequestSpec(s.method, budget, self.window, params=s.params, storage=s.storage,
                               seed=self.seed).validate(self.engine)  # the params as given: a sinks set is read
        except SpecError as exc:
            raise ConfigError(f"{s.label}: {exc}") from exc

    def request(self, label: str, budget: int | None) -> Request:
        """The validated request of method `label` at `budget` (None: a method that keeps every token, at its
        placeholder), checked once when the config was built and carried down to the engine (``request=``) as it
        is; another (label, budget) is checked on first ask."""
        requests = self.__dict__.setdefault("_requests", {})
        if (label, budget) not in requests:
            requests[label, budget] = self._validated(self.method_specs()[label], budget)
        return requests[label, budget]

    def method_specs(self) -> dict[str, MethodSpec]:
        """Label -> MethodSpec, ``full`` first, then ``methods`` in order. Raises ConfigError."""
        out: dict[str, MethodSpec] = {}
        for label in [FULL, *[m for m in self.methods if m != FULL]]:
            params = dict(self.method_params.get(label, {}))
            method = canonical_label(params.pop("method", label))
            # Storage options (kv_bits, quant_guard, ...) go to the cache, not the policy.
            params, spelled = split_storage(params)
            try:
                storage = spec_from_options(spelled)  # a registered storage's spec (`vase.storage.registry`)
            except ValueError as e:
                raise ConfigError(f"method {label!r}: {e}") from e
            try:
                policy = get_policy(method, **params)
            except UnknownMethodError as e:
                where = f"method {label!r}: " if method != label else ""
                raise ConfigError(f"{where}{e}") from e
            except (TypeError, ValueError) as e:
                raise ConfigError(f"method {label!r}: bad parameters {params}: {e}") from e
            if label == method:
                label = method = policy.name
            if label == FULL and policy.evicts:
                raise ConfigError(f"the label {FULL!r} is reserved for the full-cache reference")
            out[label] = MethodSpec(label, method, params, policy, storage)
        return out

    def to_dict(self) -> dict[str, Any]:
        return jsonable(dataclasses.asdict(self))


def jsonable(value: Any) -> Any:
    """Plain JSON types (tuples -> lists, paths -> str, dtypes -> str), keys sorted later by dumps."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _one_component(name: str) -> bool:
    """Whether ``name`` is a single, ordinary folder name (so the run stays inside output_dir)."""
    return (isinstance(name, str) and bool(name.strip()) and name == Path(name).name and "/" not in name
            and "\\" not in name and "\0" not in name and not name.startswith("."))
