"""What every `vase` command shares: the consoles, the option types, the one-line user error and the checks
that run before any model loads.

Nothing here imports torch's model stack, transformers or vLLM at import time: `vase --help`, `vase methods`
and every refusal of a flag or config value answer at once; each command imports what it needs.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer
import yaml
from rich.console import Console

if TYPE_CHECKING:
    from ..core.spec import Request

console = Console()
err_console = Console(stderr=True)

# -- options shared by several subcommands ---------------------------------------------------------------------
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Hub id, local directory or .gguf file "
                                                 "(default: the embedded SmolLM2-135M-Instruct).")]
DtypeOpt = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda or auto.")]
AttnOpt = Annotated[str, typer.Option("--attn", help="Attention kernel: sdpa, eager or flash_attention_2.")]
WindowOpt = Annotated[int, typer.Option(help="Recent tokens never evicted (also the eviction interval).")]
ParamOpt = Annotated[Optional[list[str]], typer.Option("--param", "-p", help="A method parameter, KEY=VALUE "
                                                        "(repeatable), e.g. -p n_large=64.")]
SeedOpt = Annotated[int, typer.Option(help="Seed for eviction and sampling (row r uses seed + r).")]


class UserError(Exception):
    """An error the user can fix; printed as one line."""


def warn(message: str) -> None:
    """One line on stderr for a value that is legal but ignored (or risky): the flag and what happens."""
    print(f"vase: warning: {message}", file=sys.stderr)


def given(ctx: typer.Context | None, name: str) -> bool:
    """Whether the user typed option ``name`` (not just its default)."""
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")  # by name: typer may vendor click


#: Integers torch must be able to hold (a larger budget overflows a C long deep inside torch).
INT_MAX = 2**31 - 1

#: the command line as the user gave it (`vase` and its arguments), set by `vase.cli.main.main`: a results file
#: records it (sys.argv is the caller's, e.g. pytest's, when `main` runs in-process)
_invocation: list[str] = ["vase"]


def set_invocation(args: list[str]) -> None:
    """Remember the arguments `main` was called with, for `invocation()`."""
    global _invocation
    _invocation = ["vase", *args]


def invocation() -> list[str]:
    """The vase command line being run, e.g. ["vase", "--threads", "1", "bench", ...]."""
    return list(_invocation)


def check_range(flag: str, value: int | None, maximum: int = INT_MAX, minimum: int | None = None) -> None:
    """A flag's integer within what torch can hold: one line naming the flag instead of torch's overflow."""
    if value is None:
        return
    if abs(value) > maximum:
        raise UserError(f"{flag} {value} is too {'small' if value < 0 else 'large'} (at "
                        f"{'least' if value < 0 else 'most'} {-maximum if value < 0 else maximum})")
    if minimum is not None and value < minimum:
        raise UserError(f"{flag} must be >= {minimum}, got {value}")


def check_model_opt(model: str | None) -> None:
    if model is not None and not model.strip():
        raise UserError(f"--model is empty ({model!r}): give a hub id, a model folder or a .gguf file, or leave "
                        f"--model out for the default")


def check_out_dir(path: Path | None, flag: str) -> None:
    """An output folder that can be created or used: not a file, not a dangling symlink (checked before work)."""
    if path is None:
        return
    if flag == "--out" and str(path) in ("", "."):  # `--out ''` is Path("."): the files would land in the current folder
        raise UserError(f"{flag} {str(path)!r} is the current folder: give a folder of its own (it is created), e.g. "
                        f"{flag} out")
    if path.is_symlink() and not path.exists():
        raise UserError(f"{flag} {path} is a symbolic link to nothing ({os.readlink(path)}): remove the link or "
                        f"give another folder")
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder: give a folder (it is created if missing)")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{flag} {path}: {parent} is a file, not a folder: give a folder")


def parse_params(items: list[str] | None) -> dict:
    """`KEY=VALUE` strings to a dict, values parsed as YAML scalars (64 -> int, true -> bool)."""
    params, given_as = {}, {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--param takes KEY=VALUE, got {item!r}")
        name = key.strip().replace("-", "_")
        if name in params:  # the last would win silently
            raise UserError(f"--param {name} is given twice (-p {given_as[name]} and -p {item}): give it once")
        given_as[name] = item
        try:
            params[name] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UserError(f"--param {item!r}: the value is not a valid YAML scalar ({problem}); quote it or fix "
                            f"it, e.g. -p n_large=64") from None
    return params


def checked_params(methods: list[str], items: list[str] | None, *, budgets: list[int] | None = None,
                   window: int | None = None, storage: dict | None = None, engine: str | None = None) -> dict:
    """Parse `--param` items and check, with the request spec (:class:`vase.core.spec.RequestSpec`), every method at
    every budget: the method takes them (types and ranges included), the budget rule, the reserve rule and the
    storage (--kv-bits, or ``-p kv_bits=``; not both), and what `engine` can run: all before any slow model
    load. Returns the parsed items (method parameters and storage keywords as given)."""
    return checked_requests(methods, items, budgets=budgets, window=window, storage=storage, engine=engine)[0]


def checked_requests(methods: list[str], items: list[str] | None, *, budgets: list[int] | None = None,
                     window: int | None = None, storage: dict | None = None, engine: str | None = None
                     ) -> tuple[dict, dict[tuple[str, int], Request]]:
    """:func:`checked_params`, and the validated requests it checked: ``{(method, budget): Request}`` (empty without
    `budgets`), the CLI's door, to carry down to ``vase.generate`` / an engine (``request=``) as they are."""
    from ..core.spec import RequestSpec, split_storage

    params = parse_params(items)
    spelled = split_storage(params)[1]
    if spelled and storage:
        raise UserError(f"the storage is given twice: --kv-bits/--quant-guard and -p {', '.join(spelled)}: give "
                        f"it once")
    options = {**params, **(storage or {})}
    method_params = split_storage(params)[0]
    requests: dict[tuple[str, int], Request] = {}
    for name in methods:
        if budgets is None:  # the method and its parameters only
            policy = RequestSpec.of(name, **options).build_policy()
        for b in budgets or []:
            requests[name, b] = RequestSpec.of(name, b, window if window is not None else 64, **options).validate(engine)
            policy = requests[name, b].policy
        if method_params and not (policy.evicts or policy.selects):
            warn(f"--param {', '.join(sorted(method_params))} is ignored by {policy.name!r}: it keeps every token")
    return params, requests


#: What an empty list's message offers as an example, per flag (default: by the item type).
_EXAMPLES = {"--regimes": "ample,tight", "--tasks": "arith,retrieval", "--compressions": "4,8,16",
             "--lengths": "1024,4096", "--batch-sizes": "1,4"}


def split_list(text: str, kind=str, flag: str = "the list") -> list:
    """``"a,b"`` -> ``["a", "b"]`` as ``kind``; an empty list is refused (``--budgets ''`` is no budget)."""
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not items:
        example = _EXAMPLES.get(flag) or ('128,256' if kind is int else ('4,8' if kind is float else 'snapkv,vase-attnv'))
        raise UserError(f"{flag} is empty ({text!r}): give a comma-separated list, e.g. {flag} {example}")
    return items


def quant_options(kv_bits: int, quant_guard: int | None) -> dict:
    """The EvictionCache keywords of --kv-bits / --quant-guard (none when they are left at their defaults)."""
    if kv_bits == 16 and quant_guard is None:
        return {}
    from ..storage.packing import quant_kwargs

    return quant_kwargs(kv_bits, quant_guard)


def quiet_loading() -> None:
    """Turn off transformers' weight-loading bars (vase shows its own progress); imports transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load(model: str | None, dtype: str, device: str, attn: str):
    """:func:`vase.models.load_model` under a "loading ..." line on stderr, transformers' own bars off."""
    from ..models import load_model

    quiet_loading()
    with err_console.status(f"loading {model or 'the default model'}..."):
        return load_model(model, dtype=dtype, device=device, attn_implementation=attn)


@dataclass(frozen=True)
class ModelArgs:
    """The --model/--dtype/--device/--attn options of a command that loads a model."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    attn: str = "sdpa"

    def check(self) -> None:
        """Refuse an empty --model before any work."""
        check_model_opt(self.model)

    def load(self):
        """The model and its tokenizer (see :func:`load`)."""
        return load(self.model, self.dtype, self.device, self.attn)


#: The options of ModelArgs as typer reads them from a signature: (name, type with its help, default).
_MODEL_OPTIONS = (("model", ModelOpt, None), ("dtype", DtypeOpt, "auto"), ("device", DeviceOpt, "cpu"),
                  ("attn", AttnOpt, "sdpa"))


def model_options(command: Callable[..., Any] | None = None, *, check: bool = True) -> Any:
    """A typer command whose :class:`ModelArgs` parameter stands for the four model options.

    typer reads a command's options from its signature: the wrapper's signature holds --model, --dtype,
    --device and --attn in that parameter's place (so --help lists them where they always were), and the
    command receives them as one ModelArgs. Every command that loads a model spells them the same way.
    With ``check`` (``@model_options``), the wrapper first refuses an empty --model, then an unusable --out
    folder when the command has one; ``@model_options(check=False)`` leaves both to a command that checks
    something else first.
    """
    if command is None:
        return functools.partial(model_options, check=check)
    sig = inspect.signature(command, eval_str=True)
    [slot] = [p.name for p in sig.parameters.values() if p.annotation is ModelArgs]
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        if p.name == slot:
            params += [inspect.Parameter(n, p.kind, default=d, annotation=a) for n, a, d in _MODEL_OPTIONS]
        else:
            params.append(p)

    @functools.wraps(command)
    def run(**kwargs: Any) -> Any:
        args = ModelArgs(**{n: kwargs.pop(n) for n, _, _ in _MODEL_OPTIONS})
        if check:
            args.check()
            if "out" in kwargs:
                check_out_dir(kwargs["out"], "--out")
        return command(**kwargs, **{slot: args})

    del run.__wrapped__  # typer must read the signature below, not the command's own
    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params} | {"return": sig.return_annotation}
    return run
