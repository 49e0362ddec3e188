"""LLM-as-judge: fork over judging dimensions (one batch, the answer under review computed
once), score each dimension 1-5 with `select`, join and average.

    python examples/dsl_llm_judge.py
"""

import radix_backend.lang as sgl

DIMENSIONS = ["accuracy", "clarity", "conciseness", "helpfulness"]


@sgl.function
def judge(s, question, answer):
    s += sgl.system("You are a strict reviewer of answers.")
    s += sgl.user(f"Question: {question}\nAnswer under review: {answer}")
    forks = s.fork(len(DIMENSIONS))
    forks += lambda i: sgl.user(f"Rate the answer's {DIMENSIONS[i]} from 1 (bad) to 5 (excellent). Reply with a digit.")
    forks += sgl.assistant(sgl.select("score", ["1", "2", "3", "4", "5"]))
    forks += sgl.user("Explain the rating in one sentence.") + sgl.assistant(sgl.gen("why", max_tokens=24))
    forks.join()
    scores = [int(x) for x in s["score"]]
    s.set_var("mean", sum(scores) / len(scores))


def main() -> None:
    state = judge.run(question="Why is the sky blue?",
                      answer="Because sunlight scatters off air molecules, and blue light scatters the most.",
                      temperature=0)
    for dim, score, why in zip(DIMENSIONS, state["score"], state["why"]):
        print(f"{dim:>12}: {score}  {why.strip()}")
    print(f"mean score: {state['mean']:.2f}")


if __name__ == "__main__":
    main()
