"""`vase serve`'s door for sampling settings vLLM's OpenAI server would answer wrongly without an error.

vLLM 0.32's server takes ``best_of`` and returns one choice whatever its value, and reads ``"n": true`` as n = 1
(pydantic turns the boolean into an int). Both are refused here with a 400 naming the field, through vLLM's own
extension point: `vase serve` passes ``--middleware vase.vllm.door.sampling_door`` (an ASGI HTTP middleware vLLM
adds with ``app.middleware("http")``). Nothing else of a request is read or changed.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MIDDLEWARE", "sampling_problem", "sampling_door"]

#: the import path `vase serve` gives vLLM's --middleware
MIDDLEWARE = "vase.vllm.door.sampling_door"

#: the endpoints whose bodies carry n / best_of (OpenAI completions and chat completions)
_PATHS = ("/v1/completions", "/v1/chat/completions")


def sampling_problem(body: bytes) -> str | None:
    """One line when a completions request's JSON `body` asks for ``best_of`` > 1 or an ``n`` that is not a positive
    integer; None otherwise (a body that is not a JSON object is left to vLLM, which says why)."""
    try:
        request = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    n, best_of = request.get("n"), request.get("best_of")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        return f"n must be a positive integer (the number of choices), got {json.dumps(n)}"
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of != 1):
        return (f"best_of={json.dumps(best_of)} is not supported: vLLM's server returns one choice for any best_of; "
                f"ask for n choices with n and rank them yourself")
    return None


async def sampling_door(request: Any, call_next: Any) -> Any:
    """vLLM ``--middleware``: a 400 (OpenAI's error shape) for `sampling_problem`'s requests, else the server's
    answer unchanged."""
    if request.method == "POST" and request.url.path.rstrip("/") in _PATHS:
        problem = sampling_problem(await request.body())  # starlette keeps the body for the endpoint
        if problem:
            from starlette.responses import JSONResponse

            return JSONResponse({"error": {"message": problem, "type": "BadRequestError", "param": None,
                                           "code": 400}}, status_code=400)
    return await call_next(request)
