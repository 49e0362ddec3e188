"""Multi-turn chat: roles render with the model's own chat template, and every turn reuses the
previous turns from the radix cache.

    python examples/dsl_multi_turn_chat.py
"""

import radix_backend.lang as sgl


@sgl.function
def multi_turn(s, questions):
    s += sgl.system("You are a concise assistant. Answer in one sentence.")
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=32))


def main() -> None:
    questions = ["What is the tallest mountain on Earth?", "How high is it?", "Which country is it in?"]
    state = multi_turn.run(questions=questions, temperature=0)
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
    for i in range(len(questions)):
        meta = state.get_meta_info(f"answer_{i}")
        print(f"turn {i}: {meta['prompt_tokens']} prompt tokens, {meta['cached_tokens']} from cache")


if __name__ == "__main__":
    main()
