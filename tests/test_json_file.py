"""protocol.json_file: every JSON file read back is refused in one line when damaged, whatever the damage."""
from __future__ import annotations

import pytest

from protocol.json_file import json_object, read_json


@pytest.mark.parametrize("content", [b"{cut", b"\xff\xfe not utf-8", b"[1, 2]", b"[" * 100_000 + b"]" * 100_000,
                                     b'"a string"', b""])
def test_hostile_content_is_one_line_naming_the_file_and_the_fix(tmp_path, content):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as caught:
        read_json(path, "ffr-edge", "delete it")
    message = str(caught.value)
    assert message.startswith(f"{path} is damaged or was not written by ffr-edge (") and message.endswith("; delete it")
    assert "\n" not in message


def test_build_shapes_the_value_and_its_refusals_become_the_callers_error(tmp_path):
    class StoreError(ValueError):
        pass

    path = tmp_path / "reg.json"
    path.write_text('{"token": "t"}')
    assert read_json(path, "w", "fix") == {"token": "t"}
    assert read_json(path, "w", "fix", lambda raw: json_object(raw)["token"]) == "t"
    with pytest.raises(StoreError, match=r"reg.json is damaged or was not written by w \('key'\); fix"):
        read_json(path, "w", "fix", lambda raw: raw["key"], error=StoreError)
