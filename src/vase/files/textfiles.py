"""Users' text files: UTF-8, or one line naming the file, the line of the first bad byte and the fix."""

from __future__ import annotations

__all__ = ["decode_utf8"]


def decode_utf8(data: bytes, where: str, fix: str, error: type[Exception] = ValueError) -> str:
    """``data`` as UTF-8 text; else ``error("<where>: line N is not UTF-8 text (<reason>): <fix>")``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{where}: line {line} is not UTF-8 text ({exc.reason}): {fix}") from None
