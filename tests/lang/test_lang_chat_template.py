"""Role strings derived from chat templates by rendering sentinel messages."""

from __future__ import annotations

from radix_backend.lang.chat_template import from_renderer


def chatml_with_default_system(messages, add_generation_prompt):  # SmolLM2 / Qwen2 style
    out = ""
    if messages[0]["role"] != "system":
        out += "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def llama3_like(messages, add_generation_prompt):  # BOS once, headers per turn
    out = "<|begin_of_text|>"
    for m in messages:
        out += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
    return out + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")


def mistral_like(messages, add_generation_prompt):  # no system role at all
    out = "<s>"
    for m in messages:
        if m["role"] == "system":
            raise ValueError("Conversation roles must alternate user/assistant")
        out += f"[INST] {m['content']} [/INST]" if m["role"] == "user" else f"{m['content']}</s>"
    return out


def _render(t, turns):
    """Text the interpreter would produce for these (role, content) turns."""
    text, hist = "", []
    if turns[0][0] != "system" and t.default_system_prompt is not None:
        turns = [("system", t.default_system_prompt)] + turns
    for role, content in turns:
        prefix, suffix = t.get_prefix_and_suffix(role, hist)
        text += prefix + content + suffix
        hist.append({"role": role, "content": content})
    return text


def test_chatml_default_system_is_detected():
    t = from_renderer(chatml_with_default_system)
    assert t.default_system_prompt == "You are helpful."
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert _render(t, [("user", "hi"), ("assistant", "yo")]) == chatml_with_default_system(msgs, False)


def test_llama3_bos_goes_first_only():
    t = from_renderer(llama3_like)
    assert t.first_prefix == "<|begin_of_text|>" and t.default_system_prompt is None
    turns = [("system", "s"), ("user", "u"), ("assistant", "a"), ("user", "v")]
    assert _render(t, turns) == llama3_like([{"role": r, "content": c} for r, c in turns], False)
    assert _render(t, [("user", "u")]) == llama3_like([{"role": "user", "content": "u"}], False)


def test_template_without_system_role():
    t = from_renderer(mistral_like)
    assert "system" not in t.role_prefix_and_suffix
    turns = [("user", "u"), ("assistant", "a"), ("user", "v")]
    assert _render(t, turns) == mistral_like([{"role": r, "content": c} for r, c in turns], False)


def test_underivable_template_falls_back_to_chatml():
    def broken(messages, add_generation_prompt):
        return "constant"

    assert from_renderer(broken).name == "chatml"
