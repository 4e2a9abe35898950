"""`vase serve` on loopback: vLLM's OpenAI-compatible server with the vase plugin, driven by the openai client.

One server for the module (starting vLLM takes a minute on a busy 2-core CPU); every request has a
timeout and every wait a deadline. The argument-building tests need neither vLLM nor a model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from vase.vllm.serve import DEFAULT_SERVED_NAME, ServeError, serve_argv, vase_section

HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("openai") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM and openai are not installed here (pip install -e '.[vllm]')")

START_TIMEOUT_S = 420  # vLLM imports and engine start on a loaded 2-core machine
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
METHOD, BUDGET, WINDOW = "vase-attnv", 96, 16


# ----------------------------------------------------------------------------- the argument list (no vLLM)


def test_argv_carries_plugin_config_and_passes_vllm_options(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    argv = serve_argv(str(tmp_path), method="snapkv", budget=256, window=32, params={"smooth_kernel": 7},
                      port=9001, extra=["--max-model-len", "1024"])
    assert argv[0] == sys.executable and argv[1] == "-m"
    assert argv[argv.index("--model") + 1] == str(tmp_path)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "9001"
    section = json.loads(argv[argv.index("--additional-config") + 1])
    assert section == vase_section("snapkv", 256, 32, {"smooth_kernel": 7})
    assert section["vase"]["method"] == "snapkv" and section["vase"]["budget"] == 256
    assert section["vase"]["window"] == 32 and section["vase"]["smooth_kernel"] == 7
    assert argv[-2:] == ["--max-model-len", "1024"]
    assert "--served-model-name" not in argv  # only the embedded model gets a short name


def test_argv_adds_the_sampling_door(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for method in ("snapkv", "full"):
        argv = serve_argv(str(tmp_path), method=method, budget=256, extra=[])
        assert argv[argv.index("--middleware") + 1] == "vase.vllm.door.sampling_door"


@pytest.mark.parametrize("body, status, message", [
    ({"best_of": 3, "n": 1}, 400, "best_of=3 is not supported: vLLM's server returns one choice for any best_of"),
    ({"n": True}, 400, "n must be a positive integer (the number of choices), got true"),
    ({"n": 2.5}, 400, "n must be a positive integer (the number of choices), got 2.5"),
    ({"n": 0}, 400, "n must be a positive integer (the number of choices), got 0"),
    ({"best_of": True}, 400, "best_of=true is not supported"),
    ({"n": 2, "best_of": 1}, 200, None),
    ({"n": None, "best_of": None}, 200, None),
])
def test_the_sampling_door_refuses_what_vllm_answers_wrongly(body, status, message):
    """vLLM's server returned one choice for best_of=3 and for n=true (issue 40): the middleware `vase serve` passes
    to vLLM answers 400 naming the field, and hands every other request on with its body intact."""
    fastapi = pytest.importorskip("fastapi")  # vLLM's server is a FastAPI app
    from starlette.responses import JSONResponse
    from starlette.testclient import TestClient

    from vase.vllm.door import sampling_door

    app = fastapi.FastAPI()

    async def completions(request):  # a plain route: the request as it reaches vLLM's endpoint
        return JSONResponse({"echo": await request.json()})

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_route(path, completions, methods=["POST"])
    app.middleware("http")(sampling_door)  # as vLLM adds a --middleware function
    client = TestClient(app)
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = client.post(path, json={"model": "m", "prompt": "hi", **body})
        assert reply.status_code == status, reply.text
        if message is None:
            assert reply.json() == {"echo": {"model": "m", "prompt": "hi", **body}}
        else:
            assert reply.json()["error"]["message"].startswith(message)


def test_full_is_stock_vllm(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    argv = serve_argv(str(tmp_path), method="full", budget=1, extra=[])
    assert "--additional-config" not in argv


@pytest.mark.parametrize("extra", [["--additional-config", "{}"], ["--port=1"], ["--model", "x"]])
def test_options_vase_sets_are_refused(tmp_path, extra):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServeError, match="set by vase serve"):
        serve_argv(str(tmp_path), method="snapkv", budget=256, extra=extra)


def test_bad_method_config_fails_before_start(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="budget"):
        serve_argv(str(tmp_path), method="vase-attnv", budget=8, window=64)
    with pytest.raises(ValueError, match="no-such-method|unknown"):
        serve_argv(str(tmp_path), method="no-such-method", budget=256)


def test_cli_without_model_passes_vllm_options_through(tmp_path, monkeypatch):
    import vase.vllm.serve as sv
    from vase.cli import main

    (tmp_path / "config.json").write_text("{}")
    seen: list[list[str]] = []
    monkeypatch.setattr(sv, "require_vllm", lambda: None)
    monkeypatch.setattr(sv, "run_serve", lambda argv, ready_timeout=300: seen.append(list(argv)) or 0)
    monkeypatch.setattr(sv, "_server_module", lambda: "vllm.entrypoints.openai.api_server")
    monkeypatch.setattr("vase.models.model_dir", lambda model: str(tmp_path) if model is None else model)
    main(["serve", "--max-model-len", "512", "--method", "snapkv", "--budget", "256", "--port", "9000",
          "--dtype", "float32"])
    argv = seen[0]
    assert argv[argv.index("--model") + 1] == str(tmp_path)
    assert argv[argv.index("--served-model-name") + 1] == DEFAULT_SERVED_NAME
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[-4:] == ["--max-model-len", "512", "--dtype", "float32"]
    assert json.loads(argv[argv.index("--additional-config") + 1])["vase"]["method"] == "snapkv"


def test_ready_line_names_url_model_method_and_budget(tmp_path):
    from vase.vllm.serve import ready_line

    (tmp_path / "config.json").write_text("{}")
    argv = serve_argv(str(tmp_path), method="snapkv", budget=256, window=32, host="0.0.0.0", port=9001)
    assert ready_line(argv, 73.4) == (f"vase serve: ready at http://localhost:9001/v1 (model {tmp_path}, method snapkv, "
                                      f"budget 256, window 32) after 73 s")
    full = serve_argv(str(tmp_path), method="full", budget=256, port=9002)
    assert "method full (stock vLLM)" in ready_line(full, 1.0)


def test_not_a_model_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        serve_argv(str(tmp_path), method="snapkv", budget=256)


# ----------------------------------------------------------------------------- the live server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, port: int, log_path) -> float:
    """Seconds until `vase serve` printed its ready line (within START_TIMEOUT_S, the stated start-up bound)."""
    t0 = time.monotonic()
    deadline = t0 + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if "vase serve: ready at" in log_path.read_text(errors="replace"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                assert r.status == 200  # the line is printed only once the server answers
            return time.monotonic() - t0
        time.sleep(2)
    raise AssertionError(f"no ready line after {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")


def _start(tmp_path, port: int) -> tuple[subprocess.Popen, object]:
    log_path = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "vase.cli", "serve", "--method", METHOD, "--budget", str(BUDGET),
           "--window", str(WINDOW), "--port", str(port), "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(64 * 2**20), "--dtype", "float32", "--max-num-seqs", "4", "--enforce-eager",
           "--distributed-executor-backend", "uni"]  # one start-up less on a GPU (vLLM's CPU platform turns it to mp)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log_path


def _stop(proc: subprocess.Popen, sig: int) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: the server and its engine processes
        proc.wait(timeout=30)
        raise AssertionError(f"server ignored signal {sig} for {STOP_TIMEOUT_S}s") from None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vLLM and openai are not installed here (pip install -e '.[vllm]')")
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    proc, log_path = _start(tmp, port)
    try:
        seconds = _wait_ready(proc, port, log_path)
        print(f"\nvase serve answered after {seconds:.0f} s")  # the start-up time the README quotes (pytest -s)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        raise
    state = {"proc": proc, "port": port, "log": log_path}
    yield state
    if proc.poll() is None:  # the shutdown test did not run (a -k selection): stop it anyway
        _stop(proc, signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="none",
                         timeout=REQUEST_TIMEOUT_S, max_retries=0)


@needs_vllm
def test_models_lists_the_embedded_model(client):
    assert [m.id for m in client.models.list().data] == [DEFAULT_SERVED_NAME]


@needs_vllm
def test_completion_returns_text(client):
    r = client.completions.create(model=DEFAULT_SERVED_NAME, prompt="The capital of France is", max_tokens=24,
                                  temperature=0.0)
    assert r.choices[0].text.strip()
    assert 1 <= r.usage.completion_tokens <= 24


@needs_vllm
def test_chat_completion_returns_text(client):
    r = client.chat.completions.create(model=DEFAULT_SERVED_NAME, max_tokens=24, temperature=0.0,
                                       messages=[{"role": "user", "content": "Name a colour."}])
    assert r.choices[0].message.content.strip()


@needs_vllm
def test_long_completion_past_the_budget(client):
    # 200 tokens with B=96, w=16: the request evicts several times when the plugin is active
    r = client.completions.create(model=DEFAULT_SERVED_NAME, prompt="Count: 1, 2, 3,", max_tokens=200,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 200
    assert r.choices[0].finish_reason == "length"


@needs_vllm
def test_streaming_streams(client):
    stream = client.chat.completions.create(model=DEFAULT_SERVED_NAME, max_tokens=16, temperature=0.0,
                                            messages=[{"role": "user", "content": "Say hello."}], stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2  # more than one chunk: it streamed
    assert "".join(pieces).strip()


@needs_vllm
def test_two_concurrent_requests_complete(client):
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        try:
            results[i] = client.completions.create(model=DEFAULT_SERVED_NAME, prompt=f"Story {i}:", max_tokens=48,
                                                   temperature=0.6, seed=i, extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads)
    for i in range(2):
        assert not isinstance(results[i], Exception), results[i]
        assert results[i].usage.completion_tokens == 48


@needs_vllm
def test_bad_requests_get_4xx_and_server_keeps_serving(client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=DEFAULT_SERVED_NAME, prompt="hi", max_tokens=-1)
    r = client.completions.create(model=DEFAULT_SERVED_NAME, prompt="Hello", max_tokens=4, temperature=0.0)
    assert r.usage.completion_tokens >= 1


@needs_vllm
def test_ready_line_says_where_and_what(server):
    line = next(x for x in server["log"].read_text(errors="replace").splitlines() if "vase serve: ready at" in x)
    assert line.startswith(f"vase serve: ready at http://127.0.0.1:{server['port']}/v1 (model {DEFAULT_SERVED_NAME}, "
                           f"method {METHOD}, budget {BUDGET}, window {WINDOW}) after ")


def _post(port: int, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@needs_vllm
@pytest.mark.parametrize("case, body, status, words", [
    ("malformed-json", b'{"model": "x", "prompt": ', 400, "json"),
    ("negative-max-tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("huge-max-tokens", {"prompt": "hi", "max_tokens": 10**9}, 400, "max"),
    ("unknown-model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, 404, "no-such-model"),
    ("prompt-past-context", {"prompt": "word " * 2000, "max_tokens": 4}, 400, "context"),
    ("best-of-3", {"prompt": "hi", "max_tokens": 2, "best_of": 3}, 400, "best_of=3 is not supported"),  # issue 40
    ("n-true", {"prompt": "hi", "max_tokens": 2, "n": True}, 400, "n must be a positive integer"),
])
def test_bad_request_is_4xx_with_a_message_and_the_server_keeps_serving(server, case, body, status, words):
    if isinstance(body, dict):
        body = json.dumps({"model": DEFAULT_SERVED_NAME, **body}).encode()
    code, text = _post(server["port"], body)
    assert code == status, (case, code, text[:300])
    assert words in text.lower(), (case, text[:300])  # the message says what was wrong
    ok, reply = _post(server["port"], json.dumps({"model": DEFAULT_SERVED_NAME, "prompt": "Hello", "max_tokens": 2,
                                                  "temperature": 0.0}).encode())
    assert ok == 200, reply[:300]


@needs_vllm
def test_zz_sigint_shuts_down_cleanly(server):
    """Last in the module (name order): Ctrl-C stops the server and its engine, exit status 0."""
    proc = server["proc"]
    assert proc.poll() is None
    rc = _stop(proc, signal.SIGINT)
    assert rc == 0, server["log"].read_text()[-2000:]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=5)
