"""A ReAct-style agent loop: the model picks a tool with `select`, writes its input with `gen`,
the program runs the tool in Python and appends the observation, until it picks "finish".

    python examples/dsl_react_agent.py
"""

import ast
import operator

import radix_backend.lang as sgl

FACTS = {"france": "Paris is the capital of France; population about 2.1 million.",
         "jupiter": "Jupiter is the largest planet; it has 95 known moons."}


def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers, safely (no eval)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def search(query: str) -> str:
    hits = [v for k, v in FACTS.items() if k in query.lower()]
    return hits[0] if hits else "no result"


TOOLS = {"calculator": calculator, "search": search}


@sgl.function
def react_agent(s, question, max_steps=3):
    s += ("Answer the question. Use tools when needed.\n"
          "Tools: calculator (arithmetic like 2*3+1), search (facts about a topic), finish (give the answer).\n\n"
          "Question: How many moons does Jupiter have?\n"
          "Thought: I should look up Jupiter.\nAction: search\nAction Input: jupiter\n"
          "Observation: Jupiter is the largest planet; it has 95 known moons.\n"
          "Thought: I know the answer.\nAction: finish\nAction Input: 95\n\n"
          "Question: What is 12 times 7?\n"
          "Thought: I need arithmetic.\nAction: calculator\nAction Input: 12*7\nObservation: 84\n"
          "Thought: I know the answer.\nAction: finish\nAction Input: 84\n\n")
    s += "Question: " + question + "\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=16, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{step}", ["calculator", "search", "finish"]) + "\n"
        s += "Action Input:" + sgl.gen(f"input_{step}", max_tokens=12, stop="\n") + "\n"
        action, arg = s[f"action_{step}"], s[f"input_{step}"].strip()
        if action == "finish":
            s.set_var("answer", arg)
            return
        s += "Observation: " + TOOLS[action](arg) + "\n"
    s += "Final answer:" + sgl.gen("answer", max_tokens=12, stop="\n")


def main() -> None:
    state = react_agent.run(question="What is 15 times 4?", temperature=0)
    print(state.text().split("\n\n")[-1])
    print("answer:", state["answer"])


if __name__ == "__main__":
    main()
