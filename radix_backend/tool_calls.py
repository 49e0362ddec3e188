"""Constrained tool calling, shared by the adapters and the OpenAI server: the tools' JSON schema
that decoding is constrained to, the system text that tells the model about the tools, and the
parser of the reply.

A reply is one JSON object, `{"name": <tool>, "arguments": {...}}`, or (when text is allowed)
`{"response": "<text>"}`; with parallel calls, a non-empty array of them. Constrained decoding
makes every reply parse, unless max_tokens cut it off.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequestError


def close_objects(schema: Any) -> Any:
    """Copy of `schema` where object schemas that list `properties` but say nothing about extra
    keys get `additionalProperties: false`. Pydantic and TypedDict schemas (and tool arguments)
    mean exactly their fields; left open, a small model can keep inventing keys until max_tokens."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    if "properties" in out and isinstance(out["properties"], dict) and "additionalProperties" not in out \
            and out.get("type", "object") == "object":
        out["additionalProperties"] = False
    return out


@dataclass
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


TEXT_REPLY_KEY = "response"
TOOL_CALL_MIN_TOKENS = 256  # the constrained JSON of a tool call with its arguments, with room to spare


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`messages` with `text` appended to the system message (one is added first when there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tool_call_schema(tools: list[ToolSpec], *, allow_text: bool, parallel: bool = False) -> dict[str, Any]:
    """JSON schema whose instances are exactly the allowed replies: one call of any tool
    ({"name": <tool>, "arguments": {...}}), or, with allow_text, {"response": "<text>"}.

    `$defs` of the tools' argument schemas are hoisted to the root so `#/$defs/...` refs resolve.
    """
    defs: dict[str, Any] = {}
    options: list[dict[str, Any]] = []
    for tool in tools:
        params = close_objects(dict(tool.parameters or {"type": "object", "properties": {}}))
        for key in ("$defs", "definitions"):
            for def_name, def_schema in (params.pop(key, None) or {}).items():
                if def_name in defs and defs[def_name] != def_schema:
                    raise InvalidRequestError(f"tools define conflicting schemas named {def_name!r}; rename one")
                defs[def_name] = def_schema
        params.pop("title", None)
        options.append({"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if allow_text:
        options.append({"type": "object", "properties": {TEXT_REPLY_KEY: {"type": "string"}},
                        "required": [TEXT_REPLY_KEY], "additionalProperties": False})
    call: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1} if parallel else dict(call)
    if defs:
        schema["$defs"] = defs
    return schema


def tool_instructions(tools: list[ToolSpec], *, allow_text: bool) -> str:
    """System text telling the model which tools exist and what a reply looks like."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
                        for t in tools)
    text = ("You can call these tools:\n" + listing +
            '\nTo call a tool, reply with JSON: {"name": <tool name>, "arguments": <arguments object>}.')
    if allow_text:
        text += f'\nTo answer without a tool, reply with JSON: {{"{TEXT_REPLY_KEY}": <your answer>}}.'
    return text


@dataclass
class ParsedToolReply:
    text: str  # answer text when the model chose not to call a tool
    calls: list[dict[str, Any]]  # [{"name", "args", "id"}]


def constrain_to_tools(messages: list[dict[str, Any]], params: Any, specs: list[ToolSpec], *, allow_text: bool,
                       parallel: bool = False, min_tokens: int = TOOL_CALL_MIN_TOKENS,
                       **changes: Any) -> tuple[list[dict[str, Any]], Any]:
    """A request's messages with the tools' instructions, and its SamplingParams decoding under the
    allowed calls' schema with room for at least `min_tokens` (a call cut off cannot parse; callers
    pass 0 to keep a max_tokens the user set). `changes` are further SamplingParams fields."""
    params = params.copy(json_schema=tool_call_schema(specs, allow_text=allow_text, parallel=parallel),
                         max_new_tokens=max(params.max_new_tokens, min_tokens), **changes)
    return with_system_text(messages, tool_instructions(specs, allow_text=allow_text)), params


def tool_call_json(calls: list[dict[str, Any]]) -> str:
    """Earlier calls ([{"name", "arguments"}]) as the JSON the model writes for them (one object, or
    an array for several), so a replayed turn reads like the model's own in the prompt."""
    return json.dumps(calls[0] if len(calls) == 1 else calls)


def choose_tools(specs: list[ToolSpec], tool_choice: Any) -> tuple[list[ToolSpec], bool]:
    """(tools the reply may call, whether a plain-text reply is allowed) for an OpenAI-style
    `tool_choice`: None/"auto", "none", "required" (also LangChain's "any" and True), or one tool
    named as a string, `{"name": ...}` or `{"type": "function", "function": {"name": ...}}`."""
    if not specs or tool_choice == "none":
        return [], True
    if tool_choice in (None, "auto"):
        return specs, True
    if tool_choice in ("required", "any", True):
        return specs, False
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    chosen = [s for s in specs if s.name == name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} names no offered tool; offered: {[s.name for s in specs]}")
    return chosen, False


def parse_complete_tool_reply(raw: str, finish_reason: str | None) -> ParsedToolReply:
    """`parse_tool_reply` of a finished reply; one that max_tokens cut off is an error saying so."""
    if finish_reason == "length":
        raise InvalidRequestError("the tool call was cut off by max_tokens; raise max_tokens")
    return parse_tool_reply(raw)


def parse_tool_reply(raw: str) -> ParsedToolReply:
    """Split a constrained tool-call reply into plain text or tool calls."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:  # only when generation hit max_new_tokens mid-object
        raise InvalidRequestError(
            f"tool-call reply is not complete JSON (raise max_tokens?): {raw[:200]!r}") from exc
    items = data if isinstance(data, list) else [data]
    text_parts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, dict) and TEXT_REPLY_KEY in item and "name" not in item:
            text_parts.append(str(item[TEXT_REPLY_KEY]))
        elif isinstance(item, dict) and "name" in item:
            calls.append({"name": item["name"], "args": item.get("arguments") or {},
                          "id": f"call_{uuid.uuid4().hex[:24]}"})
        else:
            raise InvalidRequestError(f"unexpected tool-call reply item: {item!r}")
    return ParsedToolReply(text="\n".join(text_parts), calls=calls)
