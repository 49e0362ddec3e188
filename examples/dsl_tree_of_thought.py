"""Tree-of-thought style fork/join: propose several approaches in parallel branches (one batch,
the question computed once), let the model vote for the best, then answer with it.

    python examples/dsl_tree_of_thought.py
"""

import radix_backend.lang as sgl


@sgl.function
def tree_of_thought(s, question, num_branches=3):
    s += sgl.system("You are a careful problem solver.")
    s += sgl.user("Question: " + question + "\nPropose one short approach to solve it.")
    branches = s.fork(num_branches)
    # a different seed per branch: reproducible, yet the branches explore different approaches
    branches += lambda i: sgl.assistant(sgl.gen("approach", max_tokens=32, temperature=0.9, seed=i))
    branches.join()

    listing = "\n".join(f"{i + 1}. {a.strip()}" for i, a in enumerate(s["approach"]))
    s += sgl.assistant("Possible approaches:\n" + listing)
    s += sgl.user("Which approach is best? Reply with its number.")
    s += sgl.assistant(sgl.select("best", [str(i + 1) for i in range(num_branches)]))
    chosen = s["approach"][int(s["best"]) - 1]
    s += sgl.user("Use approach: " + chosen.strip() + "\nNow give the final answer in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=32, temperature=0))


def main() -> None:
    state = tree_of_thought.run(question="A shop sells pens at 3 for $2. How much do 12 pens cost?")
    for i, a in enumerate(state["approach"]):
        print(f"approach {i + 1}: {a.strip()}")
    print("best:", state["best"])
    print("answer:", state["answer"].strip())
    print("cache:", sgl.get_server_info()["cache_stats"])


if __name__ == "__main__":
    main()
