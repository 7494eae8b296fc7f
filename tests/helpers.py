"""Helpers that several test modules share.

Tool results: every result a test reads goes through `tool_payload`, which checks it the way the
strictest MCP clients read it (the TypeScript SDK validates `structuredContent` against the tool's
declared `outputSchema`, even when `isError` is true) and returns the payload. So the whole suite is
an output-schema conformance test: a success whose structured content does not fit the schema, or
an error that carries structured content, fails whichever test produced it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jsonschema

import server
from corpus_rules import ErrorCode

ERROR_KEYS = {"code", "message", "hint"}
ERROR_CODES = {str(code) for code in ErrorCode}


@functools.cache
def output_validators() -> dict[str, jsonschema.protocols.Validator]:
    """One validator per tool, from the outputSchema the server declares in tools/list."""
    validators = {}
    for tool in server.tool_definitions():
        schema = tool.output_schema
        jsonschema.Draft202012Validator.check_schema(schema)
        validators[tool.name] = jsonschema.Draft202012Validator(schema)
    return validators


def _as_wire_dict(result: Any) -> dict[str, Any]:
    """A tools/call result as it travels in JSON-RPC (camelCase keys), from either an SDK result
    object or a raw JSON-RPC `result` member."""
    if isinstance(result, Mapping):
        return dict(result)
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def tool_payload(tool: str, result: Any) -> tuple[bool, dict[str, Any]]:
    """(is_error, payload) of one tools/call result, after checking that every client can read it.

    Success: structuredContent is present, valid against the tool's outputSchema, and the first text
    content carries the same JSON. Error: `isError: true`, no structuredContent (it would contradict
    the outputSchema), and the text content is `{"error": {code, message, hint}}` with a code from
    the vocabulary.
    """
    wire = _as_wire_dict(result)
    text = wire["content"][0]["text"]
    if wire.get("isError"):
        assert wire.get("structuredContent") is None, f"an error result carries structuredContent: {wire}"
        payload = json.loads(text)
        assert set(payload) == {"error"} and set(payload["error"]) == ERROR_KEYS, payload
        assert payload["error"]["code"] in ERROR_CODES, payload
        assert all(isinstance(payload["error"][key], str) for key in ERROR_KEYS), payload
        assert payload["error"]["code"] and payload["error"]["message"], payload
        return True, payload
    payload = wire.get("structuredContent")
    assert isinstance(payload, dict), f"a success result without structuredContent: {wire}"
    errors = sorted(output_validators()[tool].iter_errors(payload), key=lambda e: list(e.path))
    assert not errors, f"{tool} result does not fit its outputSchema: {errors[0].message} at {list(errors[0].path)}"
    assert json.loads(text) == payload, "the text content must carry the same JSON as the structured content"
    return False, payload
