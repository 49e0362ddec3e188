"""Role prefix/suffix strings for `system/user/assistant`, SGLang-style (sglang.lang.chat_template).

`from_renderer` derives them from the model's own chat template by rendering messages with
sentinel contents and cutting around the sentinels, so `s += user(...)` produces exactly the
text `Engine.apply_chat_template` would (same tokens, shared radix-cache prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
_SYS, _USER, _ASSIST = "SGLSENTINELSYSTEM7f3a", "SGLSENTINELUSER7f3a", "SGLSENTINELASSISTANT7f3a"

Renderer = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> prompt text


@dataclass
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    # inserted as a system turn when a program starts with another role ("" = an empty system turn)
    default_system_prompt: str | None = None
    first_prefix: str = ""  # text before the very first message (e.g. a BOS string)
    stop_str: list[str] = field(default_factory=list)

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}; it supports {sorted(self.role_prefix_and_suffix)}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if not hist_messages:
            prefix = self.first_prefix + prefix
        return prefix, suffix


def chatml(default_system_prompt: str | None = None) -> ChatTemplate:
    return ChatTemplate(
        name="chatml",
        role_prefix_and_suffix={r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
        default_system_prompt=default_system_prompt,
        stop_str=["<|im_end|>"],
    )


def default_template() -> ChatTemplate:
    """SGLang's plain-text "default" template, for backends that know no chat format."""
    return ChatTemplate(
        name="default",
        role_prefix_and_suffix={"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
    )


def _split(text: str, sentinel: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise ValueError(f"sentinel {sentinel} rendered {text.count(sentinel)} times")
    head, tail = text.split(sentinel)
    return head, tail


def _strip_prefix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ValueError("chat template is not incremental (a longer conversation does not extend a shorter one)")
    return text[len(prefix):]


def from_renderer(render: Renderer, name: str = "model") -> ChatTemplate:
    """Derive a ChatTemplate from a function rendering messages (e.g. `engine.apply_chat_template`).

    Falls back to ChatML if the template cannot be cut into per-role prefix/suffix strings.
    """
    try:
        return _derive(render, name)
    except Exception as first:  # noqa: BLE001 - any template quirk means "not derivable this way"
        try:  # templates without a separate system turn (Mistral, Gemma): user/assistant only
            return _derive_without_system(render, name)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not derive role strings from the chat template of %s (%s; %s); using ChatML",
                           name, first, exc)
            return chatml()


def _derive(render: Renderer, name: str) -> ChatTemplate:
    sys_msg = {"role": "system", "content": _SYS}
    user_msg = {"role": "user", "content": _USER}
    asst_msg = {"role": "assistant", "content": _ASSIST}
    t_s = render([sys_msg], False)
    t_su = render([sys_msg, user_msg], False)
    t_sua = render([sys_msg, user_msg, asst_msg], False)
    t_su_gen = render([sys_msg, user_msg], True)

    sys_head, sys_suffix = _split(t_s, _SYS)
    user_prefix, user_suffix = _split(_strip_prefix(t_su, t_s), _USER)
    _, asst_suffix = _split(_strip_prefix(t_sua, t_su), _ASSIST)
    # The generation prompt is what the model was trained to continue from: use it as the
    # assistant prefix so `assistant(gen(...))` matches `apply_chat_template(add_generation_prompt=True)`.
    asst_prefix = _strip_prefix(t_su_gen, t_su)

    # What precedes a conversation that starts with a user turn: either a BOS-like string, or a
    # whole default system message (SmolLM2, Qwen), or nothing.
    u_head, _ = _split(render([user_msg], False), _USER)
    head = u_head[: len(u_head) - len(user_prefix)] if u_head.endswith(user_prefix) else None
    if head is None:
        raise ValueError("user prefix differs between first and later turns")
    first_prefix, sys_prefix, default_system = "", sys_head, None
    if head and head.startswith(sys_head) and head.endswith(sys_suffix) and len(head) >= len(sys_head) + len(sys_suffix):
        default_system = head[len(sys_head): len(head) - len(sys_suffix)]
    elif head:
        if not sys_head.startswith(head):
            raise ValueError(f"cannot place the conversation head {head!r}")
        first_prefix, sys_prefix = head, sys_head[len(head):]
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix={
            "system": (sys_prefix, sys_suffix),
            "user": (user_prefix, user_suffix),
            "assistant": (asst_prefix, asst_suffix),
        },
        default_system_prompt=default_system,
        first_prefix=first_prefix,
    )


def _derive_without_system(render: Renderer, name: str) -> ChatTemplate:
    user_msg = {"role": "user", "content": _USER}
    asst_msg = {"role": "assistant", "content": _ASSIST}
    user2_msg = {"role": "user", "content": _SYS}  # any second distinct sentinel
    t_u = render([user_msg], False)
    t_ua = render([user_msg, asst_msg], False)
    t_uau = render([user_msg, asst_msg, user2_msg], False)
    head, user_suffix = _split(t_u, _USER)
    asst_prefix = _strip_prefix(render([user_msg], True), t_u)
    _, asst_suffix = _split(_strip_prefix(t_ua, t_u), _ASSIST)
    user_prefix, user_suffix2 = _split(_strip_prefix(t_uau, t_ua), _SYS)
    if user_suffix2 != user_suffix or not head.endswith(user_prefix):
        raise ValueError("user turns render differently depending on their position")
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix={"user": (user_prefix, user_suffix), "assistant": (asst_prefix, asst_suffix)},
        first_prefix=head[: len(head) - len(user_prefix)],
    )
