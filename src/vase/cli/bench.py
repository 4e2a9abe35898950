"""`vase bench`: decode throughput and memory of each method against the full cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (ModelArgs, invocation, ParamOpt, UserError, WindowOpt, checked_requests, console, given,
                     model_options, quant_options, quiet_loading, split_list, warn)

__all__ = ["bench", "random_model"]


@model_options
def bench(
    ctx: typer.Context,
    methods: Annotated[str, typer.Option(help="Comma-separated eviction methods (full and dynamic are added).")]
    = "vase-attnv,vase-dkv",
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets.")] = "512",
    lengths: Annotated[Optional[str], typer.Option(help="Comma-separated numbers of new tokens (default 1024,4096; "
                                                   "--engine vllm: one length, default 2048).")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1",
    window: WindowOpt = 64,
    prompt_length: Annotated[int, typer.Option(help="Random prompt tokens before decoding.")] = 128,
    warmup: Annotated[int, typer.Option(help="Untimed runs per configuration.")] = 1,
    warmup_tokens: Annotated[Optional[int], typer.Option(help="New tokens of each untimed run (default: the first "
                                                        "of --lengths; a few dozen suffice for eager runs).",
                                                        min=2)] = None,
    repeats: Annotated[int, typer.Option(help="Timed rounds: each runs every configuration once (A, B, A, B, ...; "
                                         "--engine vllm: each in a fresh engine); rates are medians, each ratio "
                                         "the median of the rounds' ratios with its range.")] = 1,
    no_dynamic: Annotated[bool, typer.Option("--no-dynamic", help="Skip transformers' DynamicCache.")] = False,
    random_init: Annotated[Optional[str], typer.Option(help="Random weights of a real architecture: qwen3-0.6b, "
                                                       "qwen3-4b, qwen3-14b, smollm2-135m, the hybrid qwen3.5-0.8b, "
                                                       "qwen3.5-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b, gpt-oss-20b, gemma3-1b, "
                                                       "gemma3-270m "
                                                       "(docs/models.md), or a config.json.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="With --random-init: only the shape's first N decoder layers "
                                                  "(its layer-type pattern kept): a shorter model with the same "
                                                  "per-layer cost, for shapes too large for this machine.",
                                                  min=1)] = None,
    param: ParamOpt = None,
    kv_bits: Annotated[int, typer.Option("--kv-bits", help="The methods store old K/V in 8, 4 or 2 bits "
                                         "(full and dynamic stay in full precision).")] = 16,
    out: Annotated[Path, typer.Option(help="Folder for bench.csv, bench.md and the plots.")] = Path("bench-out"),
    model: ModelArgs = ModelArgs(),
    engine: Annotated[str, typer.Option(help="transformers, or vllm: N requests at once into one vLLM engine with a "
                                        "fixed KV pool, stock vLLM (full) vs each method.")] = "transformers",
    requests: Annotated[int, typer.Option(help="--engine vllm: requests submitted at once.")] = 16,
    regimes: Annotated[str, typer.Option(help="--engine vllm: KV pool sizes, ample (holds every request at full "
                                         "length), tight (a quarter of them), squeeze (a sixteenth: bounded requests are "
                                         "preempted too; evicting methods only). Rows outside ample say how many "
                                         "requests' tokens equal the ample run's.")] = "ample,tight",
    pool_requests: Annotated[Optional[float], typer.Option(help="--engine vllm: instead of --regimes, a pool that "
                                                           "holds this many requests at full length.")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="--engine vllm: KV block size (vLLM's default: 128 on "
                                                     "CPU, 16 on GPU).")] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="Also run each configuration with its decode step "
                                           "torch.compile'd (full: transformers' StaticCache; the first run of each "
                                           "compiles, untimed).")] = False,
    bandwidth: Annotated[Optional[float], typer.Option(help="Memory bandwidth in GB/s for the roofline (default: "
                                                       "measured once at the start by a matrix-vector probe; 0: no "
                                                       "roofline). The ceilings beside the ratios need no bandwidth.",
                                                       min=0)] = None,
    clock: Annotated[str, typer.Option(help="wall, or cpu: time the steps by this process's CPU time (with "
                                       "--threads 1 on a CPU; a loaded shared machine's other work then does "
                                       "not count).")] = "wall",
    results: Annotated[Optional[Path], typer.Option(help="Results file (JSON: the rows with the date, commit, "
                                                    "machine, versions and command; default OUT/bench.json, "
                                                    "--engine vllm: OUT/vllm_bench.json).")]
    = None,
) -> None:
    """Decode throughput and memory of each method against the full cache, per output length."""
    from ..core.capabilities import engine_info, engine_names, refuse_unsupported

    method_list, budget_list = split_list(methods, str, "--methods"), split_list(budgets, int, "--budgets")
    if engine not in engine_names():
        raise UserError(f"--engine must be {' or '.join(engine_names())}, got {engine!r}")
    # Flags the engine would ignore are refused, not dropped: --kv-bits, --compile and --attn on vLLM.
    refuse_unsupported(engine, storage=kv_bits != 16, compile=compile_, attn=given(ctx, "attn"))
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    if results is not None and (results.name in ("", ".", "..") or results.is_dir()):
        raise UserError(f"--results must name a file (e.g. docs/results/bench.json), got {str(results)!r}")
    o = dict(lengths=lengths, window=window, param=param, requests=requests, prompt_length=prompt_length, out=out,
             regimes=regimes, pool_requests=pool_requests, block_size=block_size, repeats=repeats, results=results,
             batch_sizes=batch_sizes, clock=clock, kv_bits=kv_bits, random_init=random_init, layers=layers,
             warmup=warmup, warmup_tokens=warmup_tokens, no_dynamic=no_dynamic, compile=compile_, bandwidth=bandwidth)
    own_bench = engine_info(engine).bench
    if own_bench is not None:  # the engine runs its own bench (vLLM: N requests into one engine with a fixed KV pool)
        paths = _engine_bench(own_bench, ctx, engine, model, method_list, budget_list, o)
    else:
        paths = _decode_bench(ctx, model, method_list, budget_list, o)
    console.print(f"wrote {', '.join(str(p) for p in paths.values())}")


def _engine_bench(hook: str, ctx: typer.Context, engine: str, model: ModelArgs, method_list: list[str],
                  budget_list: list[int], o: dict) -> dict[str, Path]:
    """`bench --engine NAME` for an engine with a bench of its own (the registry's ``bench`` hook): the written
    paths. `o`: the command's other options by parameter name."""
    from ..core.capabilities import load_hook

    options = dict(model=model.model, dtype=model.dtype, methods=method_list, budgets=budget_list,
                   lengths=o["lengths"], window=o["window"], param=o["param"], requests=o["requests"],
                   prompt_length=o["prompt_length"], regimes=o["regimes"], pool_requests=o["pool_requests"],
                   block_size=o["block_size"], out=o["out"], repeats=o["repeats"], results=o["results"],
                   command=invocation(), engine=engine)
    flags = {n for n in ("random_init", "layers", "clock", "bandwidth", "batch_sizes", "warmup", "warmup_tokens",
                         "no_dynamic") if given(ctx, n)}
    return load_hook(hook)(options, flags, check_requests=checked_requests, split=split_list, log=console.print)


def _decode_bench(ctx: typer.Context, model: ModelArgs, method_list: list[str], budget_list: list[int],
                  o: dict) -> dict[str, Path]:
    """vase's own decode bench (`vase.bench.runner.run_bench`) on --model or a --random-init shape: the written
    paths. `o`: the command's other options by parameter name."""
    ignored = [f"--{n.replace('_', '-')}" for n in ("requests", "regimes", "pool_requests", "block_size")
               if given(ctx, n)]
    if ignored:
        warn(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored on the transformers engine "
             f"(they size vLLM's pool): add --engine vllm, or drop {'it' if len(ignored) == 1 else 'them'}")
    length_list = split_list(o["lengths"] or "1024,4096", int, "--lengths")
    batch_list = split_list(o["batch_sizes"], int, "--batch-sizes")
    clock, layers, random_init, bandwidth = o["clock"], o["layers"], o["random_init"], o["bandwidth"]
    if clock not in ("wall", "cpu"):
        raise UserError(f"--clock must be wall or cpu, got {clock!r}")
    import torch

    if clock == "cpu" and torch.get_num_threads() != 1:
        raise UserError("--clock cpu times one thread: add --threads 1 before the command (vase --threads 1 bench ...)")
    quant = quant_options(o["kv_bits"], None)
    # the door: every (method, budget) validated once here, carried down to each run (`run_bench(requests=)`)
    params, requests = checked_requests(method_list, o["param"], budgets=budget_list, window=o["window"],
                                        storage=quant)
    params = {**params, **quant}
    from ..bench.report import write_report, write_results_file
    from ..bench.runner import run_bench
    from ..files.provenance import finish, provenance

    record = provenance(invocation(), threads=torch.get_num_threads())  # before the measurement: its load average too
    if layers is not None and not random_init:
        raise UserError("--layers cuts a --random-init shape: add --random-init NAME, or drop --layers")
    if random_init:
        mdl = random_model(random_init, model, layers)
    else:
        mdl, _ = model.load()
    rows = run_bench(mdl, method_list, budget_list, length_list, batch_list, prompt_length=o["prompt_length"],
                     window=o["window"], warmup=o["warmup"], warmup_tokens=o["warmup_tokens"], repeats=o["repeats"],
                     include_dynamic=not o["no_dynamic"],
                     compile="both" if o["compile"] else False,
                     bandwidth="probe" if bandwidth is None else (bandwidth * 1e9 or None), clock=clock,
                     requests=requests, **params)
    paths = write_report(rows, o["out"], console=console)
    paths["results"] = write_results_file(rows, o["results"] or o["out"] / "bench.json", finish(record))
    return paths

def random_model(spec: str, model: ModelArgs, layers: int | None = None):
    """`bench --random-init`: a named shape or a config.json (its first `layers` decoder layers), random weights;
    one line naming the file if bad."""
    from ..bench.shapes import LayersError, build_random_model, shape_names
    from ..models import resolve_device, resolve_dtype

    from ..models.errors import ModelLoadError
    from ..models.options import check_attn_implementation

    dev = resolve_device(model.device)
    try:  # an --attn problem names --attn, not --random-init
        check_attn_implementation(model.attn, dev)
    except ModelLoadError as e:
        raise UserError(f"--attn {model.attn}: {e}") from None
    quiet_loading()
    try:
        return build_random_model(spec, resolve_dtype(model.dtype, dev), dev, model.attn, num_layers=layers)
    except LayersError as e:
        raise UserError(f"--layers {layers}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any reader's or config class's error means "bad file"
        if "does not support" in str(e) and "attention" in str(e):  # the shape is fine, the kernel is not (gpt-oss
            # has no sdpa in transformers): name --attn, not --random-init
            raise UserError(f"--attn {model.attn}: {spec} does not run with it ({str(e).splitlines()[0][:160]}): "
                            f"add --attn eager") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--random-init {spec}: cannot build a model from it ({type(e).__name__}: {first[:200]}); "
                        f"give a transformers config.json (with model_type) or one of "
                        f"{', '.join(n for n in shape_names() if n != 'tiny')}") from None
