"""Pieces every adapter needs: engine resolution, sampling kwargs, usage, JSON schemas, and the
tool-call pieces of radix_backend.tool_calls (re-exported: the adapters import them from here).

Kept free of framework imports so each adapter only pulls in its own framework.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from radix_backend.engine_like import EngineLike
from radix_backend.errors import InvalidRequestError, MissingDependencyError
from radix_backend.outputs import RequestMeta
from radix_backend.sampling_params import SamplingParams
from radix_backend.utils import load_json_text
from radix_backend.tool_calls import (TEXT_REPLY_KEY, TOOL_CALL_MIN_TOKENS, ParsedToolReply, ToolSpec, close_objects,
                                      constrain_to_tools, parse_tool_reply, tool_call_schema, tool_instructions,
                                      with_system_text)

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Names frameworks use for the same knob.
_ALIASES = {"max_tokens": "max_new_tokens", "num_output": "max_new_tokens", "stop_sequences": "stop"}


def require(module: str, extra: str, package: str | None = None) -> ModuleType:
    """Import an optional framework or raise MissingDependencyError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError.for_extra(package or module.split(".")[0], extra) from exc


def resolve_engine(engine: EngineLike | None, model: str | None) -> EngineLike:
    """The engine to use: the one given, else the process-shared engine for `model`."""
    if engine is not None:
        return engine
    from radix_backend.engine import get_engine

    return get_engine(model)


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any], *, stop: list[str] | None = None) -> SamplingParams:
    """Merge adapter defaults and per-call kwargs into SamplingParams; unknown names are errors."""
    merged: dict[str, Any] = {}
    for source in (defaults, overrides):
        for key, value in source.items():
            name = _ALIASES.get(key, key)
            if name not in _SAMPLING_FIELDS:
                raise InvalidRequestError(
                    f"unknown sampling argument {key!r}; use one of {sorted(_SAMPLING_FIELDS | set(_ALIASES))}")
            if value is not None:
                merged[name] = value
    if stop:
        merged["stop"] = list(merged.get("stop") or []) + [s for s in stop if s not in (merged.get("stop") or [])]
    params = SamplingParams(**merged)
    params.validate()
    return params


@dataclass
class Usage:
    """Token accounting of one request, in the names frameworks expect."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_meta(cls, meta: RequestMeta | None) -> "Usage":
        if meta is None:
            return cls(0, 0, 0)
        return cls(meta.prompt_tokens, meta.completion_tokens, meta.cached_tokens)

    def as_input_output(self) -> dict[str, int]:
        """pydantic-ai's and DSPy's usage fields (input, output and cache-read tokens)."""
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
                "cache_read_tokens": self.cached_tokens}

    def as_openai(self) -> dict[str, Any]:
        """OpenAI-style usage dict (what LlamaIndex's token counter reads from `raw["usage"]`)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "cached_tokens": self.cached_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def to_json_schema(schema: Any) -> tuple[dict[str, Any], str]:
    """(JSON schema, name) of a pydantic class, a TypedDict, a JSON schema dict or an OpenAI tool dict."""
    if isinstance(schema, str):
        schema = load_json_text(schema, "schema string")
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return close_objects(schema.model_json_schema()), schema.__name__
    if isinstance(schema, type) and hasattr(schema, "parse_raw") and hasattr(schema, "schema"):  # pydantic v1
        return close_objects(schema.schema()), schema.__name__
    if isinstance(schema, type) and hasattr(schema, "__annotations__") and hasattr(schema, "__total__"):
        from pydantic import TypeAdapter

        return close_objects(TypeAdapter(schema).json_schema()), schema.__name__
    if isinstance(schema, dict):
        if schema.get("type") == "function" and isinstance(schema.get("function"), dict):  # OpenAI tool
            fn = schema["function"]
            return dict(fn.get("parameters") or {"type": "object", "properties": {}}), fn["name"]
        if "name" in schema and "parameters" in schema:  # OpenAI function
            return dict(schema["parameters"]), schema["name"]
        if "type" in schema or "properties" in schema or "anyOf" in schema or "oneOf" in schema or "$ref" in schema:
            return close_objects(dict(schema)), str(schema.get("title", "output"))  # closed like a class schema
    raise InvalidRequestError(
        f"cannot derive a JSON schema from {schema!r}: pass a pydantic model class, a TypedDict, "
        "a JSON schema dict or an OpenAI tool/function dict")


def schema_instructions(schema: dict[str, Any], name: str) -> str:
    """System text describing the reply's JSON fields, descriptions included, so the model knows what
    each field means (decoding is constrained to the schema as well)."""
    lines = [f"Reply with one JSON object ({name})" + (f": {schema['description']}" if schema.get("description")
                                                        else "."), "Fields:"]
    required = set(schema.get("required") or [])
    for field_name, spec in (schema.get("properties") or {}).items():
        kind = spec.get("type") or "/".join(str(a.get("type")) for a in spec.get("anyOf", []) if isinstance(a, dict))
        note = f" - {spec['description']}" if spec.get("description") else ""
        lines.append(f"- {field_name} ({kind or 'any'}{'' if field_name in required else ', optional'}){note}")
    return "\n".join(lines)


def parse_structured(schema: Any, text: str) -> Any:
    """The reply as the schema's type: a pydantic (v2 or v1) instance, else the decoded JSON."""
    if isinstance(schema, type) and hasattr(schema, "model_validate_json"):
        return schema.model_validate_json(text)
    if isinstance(schema, type) and hasattr(schema, "parse_raw"):
        return schema.parse_raw(text)
    return json.loads(text)


def message_text(content: Any) -> str:
    """Text of a message content that may be a string or a list of content blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            else:
                raise InvalidRequestError(f"only text content is supported by this engine, got block {block!r}")
        return "".join(parts)
    if content is None:
        return ""
    raise InvalidRequestError(f"unsupported message content {type(content).__name__}")


__all__ = ["TEXT_REPLY_KEY", "TOOL_CALL_MIN_TOKENS", "ParsedToolReply", "ToolSpec", "Usage", "close_objects",
           "constrain_to_tools", "message_text",
           "parse_structured", "parse_tool_reply", "require", "resolve_engine", "sampling_params", "schema_instructions",
           "to_json_schema", "tool_call_schema", "tool_instructions", "with_system_text"]
