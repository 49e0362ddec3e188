"""OpenAI tool calling on /v1/chat/completions, on the engine's constrained tool-call decoding.

`tools` + `tool_choice` ("auto": a call or a plain answer; "required": a call; a named function:
that call; "none": no tools) become a JSON schema the reply is constrained to and a system text
that lists the tools (radix_backend.tool_calls, shared with the adapters). The reply is parsed
back into OpenAI's `message.tool_calls` (finish_reason "tool_calls") or plain `content`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..tool_calls import TOOL_CALL_MIN_TOKENS, ToolSpec, parse_tool_reply, tool_call_schema, tool_instructions
from .protocol import ChatCompletionRequest, ChatMessage, FunctionCallOut, ToolCallOut

__all__ = ["TOOL_CALL_MIN_TOKENS", "ToolPlan", "tool_plan", "tool_reply"]


@dataclass(frozen=True)
class ToolPlan:
    """What the request allows the model to reply."""

    specs: list[ToolSpec]
    allow_text: bool
    parallel: bool

    @property
    def schema(self) -> dict[str, Any]:
        return tool_call_schema(self.specs, allow_text=self.allow_text, parallel=self.parallel)

    @property
    def instructions(self) -> str:
        return tool_instructions(self.specs, allow_text=self.allow_text)


def _spec(tool: Any, index: int) -> ToolSpec:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ..., "
                                  "'parameters': {...}}}}")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object")
    return ToolSpec(fn["name"], str(fn.get("description") or ""), params)


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan, or None when it asks for no tool calling."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if not req.tools:
        if choice not in ("auto", "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    specs = [_spec(tool, i) for i, tool in enumerate(req.tools)]
    if len({s.name for s in specs}) != len(specs):
        raise InvalidRequestError("tools must have distinct function names")
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else False
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan(specs, allow_text=True, parallel=parallel)
    if choice == "required":
        return ToolPlan(specs, allow_text=False, parallel=parallel)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    chosen = [s for s in specs if s.name == name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice must be 'auto', 'required', 'none' or "
                                  f"{{'type': 'function', 'function': {{'name': <one of the tools>}}}}, got {choice!r}")
    return ToolPlan(chosen, allow_text=False, parallel=parallel)


def tool_reply(text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
    """The assistant message and finish reason of a constrained tool reply. A reply cut off by
    max_tokens is not JSON: it comes back as content with finish_reason "length"."""
    try:
        parsed = parse_tool_reply(text)
    except InvalidRequestError:
        return ChatMessage(content=text), finish_reason
    if not parsed.calls:
        return ChatMessage(content=parsed.text), finish_reason
    calls = [ToolCallOut(index=i, id=c["id"], function=FunctionCallOut(name=c["name"], arguments=json.dumps(c["args"])))
             for i, c in enumerate(parsed.calls)]
    return ChatMessage(content=parsed.text or None, tool_calls=calls), "tool_calls"
