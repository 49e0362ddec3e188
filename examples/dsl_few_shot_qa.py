"""Few-shot QA with the DSL: one program, a batch of questions sharing a few-shot header.

`run_batch` traces the program, puts the shared header in the radix cache once, then runs the
questions concurrently on the in-process engine (embedded SmolLM2-135M-Instruct).

    python examples/dsl_few_shot_qa.py
"""

import radix_backend.lang as sgl

EXAMPLES = [
    ("What is the capital of Italy?", "Rome"),
    ("How many legs does a spider have?", "Eight"),
    ("What color is the sky on a clear day?", "Blue"),
    ("What is the largest planet in the solar system?", "Jupiter"),
]


@sgl.function
def few_shot_qa(s, question):
    s += "Answer each question with one word.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    questions = ["What is the capital of France?", "How many days are in a week?", "What is frozen water called?",
                 "Which animal barks?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0, progress_bar=True)
    for q, st in zip(questions, states):
        meta = st.get_meta_info("answer")
        print(f"{q!r:50} -> {st['answer'].strip()!r:14} (prompt {meta['prompt_tokens']} tokens, "
              f"{meta['cached_tokens']} from cache)")
    print("cache:", sgl.get_server_info()["cache_stats"])


if __name__ == "__main__":
    main()
