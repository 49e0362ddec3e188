"""The shared tool-calling rules every adapter uses: which tools a tool_choice allows, and a reply
that max_tokens cut off."""

from __future__ import annotations

import pytest

from radix_backend.errors import InvalidRequestError
from radix_backend.tool_calls import ToolSpec, choose_tools, parse_complete_tool_reply

SPECS = [ToolSpec("a", "", {"type": "object"}), ToolSpec("b", "", {"type": "object"})]


@pytest.mark.parametrize("choice,names,text", [
    (None, ["a", "b"], True), ("auto", ["a", "b"], True), ("none", [], True),
    ("required", ["a", "b"], False), ("any", ["a", "b"], False), (True, ["a", "b"], False),
    ("b", ["b"], False), ({"name": "b"}, ["b"], False), ({"type": "function", "function": {"name": "a"}}, ["a"], False),
])
def test_choose_tools_follows_tool_choice(choice, names, text):
    specs, allow_text = choose_tools(SPECS, choice)
    assert [s.name for s in specs] == names and allow_text is text


def test_choose_tools_refuses_an_unknown_name_and_offers_nothing_without_tools():
    with pytest.raises(InvalidRequestError, match="names no offered tool"):
        choose_tools(SPECS, "c")
    assert choose_tools([], "required") == ([], True)


def test_a_cut_off_reply_is_an_error_naming_max_tokens():
    assert parse_complete_tool_reply('{"name": "a", "arguments": {}}', "stop").calls[0]["name"] == "a"
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        parse_complete_tool_reply('{"name": "a", "argu', "length")
