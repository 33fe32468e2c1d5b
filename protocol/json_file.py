"""JSON files read back (a device's home, a coordinator's state, a run folder), checked as if an attacker wrote them.

Every such file is parsed and shaped by `build` in one place; anything that is not JSON, or that `build` refuses
(a missing key, a wrong type), is one line naming the file, who should have written it and what to do, never a
bare json or KeyError message.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
MAX_BYTES = 64 * 1024 * 1024  # far above any state or summary file ffr-edge writes


def json_object(raw: Any) -> dict:
    """`build` for a file that holds one JSON object."""
    if not isinstance(raw, dict):
        raise TypeError("not a JSON object")
    return raw


def read_json(path: Path, writer: str, fix: str, build: Callable[[Any], T] = json_object,
              error: type[ValueError] = ValueError) -> T:
    """`build(the file's JSON)`; `error` ("PATH is damaged or was not written by WRITER (why); FIX") when the file is
    not JSON (or nested too deep, or too large) or `build` raises ValueError, TypeError, KeyError or AttributeError."""
    try:
        if Path(path).stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES // 2**20} MiB")
        return build(json.loads(Path(path).read_text()))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:  # UnicodeDecodeError: a ValueError
        why = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise error(f"{path} is damaged or was not written by {writer} ({why}); {fix}") from None
