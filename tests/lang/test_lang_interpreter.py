"""DSL interpreter, tracer and API on a scripted fake backend (no model): fast logic tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import radix_backend.lang as sgl
from radix_backend.errors import InvalidRequestError
from radix_backend.lang.chat_template import chatml
from radix_backend.lang.ir import REGEX_FLOAT, REGEX_INT
from radix_backend.outputs import ChoiceScore, GenerateOutput, RequestMeta, StreamChunk
from radix_backend.sampling_params import SamplingParams


class FakeBackend(sgl.BaseBackend):
    """Answers with `responder(prompt, params)`; scores a choice by `prefs` (logprob per char)."""

    def __init__(self, responder: Callable[[str, SamplingParams], str] | None = None,
                 prefs: dict[str, float] | None = None) -> None:
        self.responder = responder or (lambda prompt, params: "ok")
        self.prefs = prefs or {}
        self.batches: list[list[str]] = []
        self.params: list[SamplingParams] = []
        self.cached: list[str] = []
        self.scored: list[tuple[str, list[str], bool]] = []
        self.lock = threading.Lock()

    def get_chat_template(self):
        return chatml(default_system_prompt="SYS")

    def generate(self, prompts, params):
        with self.lock:
            self.batches.append(list(prompts))
            self.params.extend(params)
        outs = []
        for prompt, p in zip(prompts, params):
            text = "" if p.max_new_tokens == 0 else self.responder(prompt, p)
            outs.append(GenerateOutput(text, list(range(len(text))), "stop",
                                       RequestMeta(prompt_tokens=len(prompt), completion_tokens=len(text))))
        return outs

    def generate_stream(self, prompt, params) -> Iterator[StreamChunk]:
        text = self.responder(prompt, params)
        for i, ch in enumerate(text):
            time.sleep(0.01)  # let the reader see increments
            last = i == len(text) - 1
            yield StreamChunk(ch, [i], "stop" if last else None, RequestMeta(completion_tokens=len(text)) if last else None)

    def cache_prefix(self, prefix):
        self.cached.append(prefix)

    def score(self, prefix, continuations, *, unconditional=False):
        self.scored.append((prefix, list(continuations), unconditional))
        out = []
        for c in continuations:
            lp = self.prefs.get(c, -2.0)
            out.append(ChoiceScore(c, list(range(len(c))), [lp] * len(c), [-1.0] * len(c) if unconditional else None))
        return out


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def test_gen_text_variables_and_meta(backend):
    @sgl.function
    def prog(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=7, stop="\n")
        s += "\nDone."

    state = prog.run(question="why?", backend=backend, temperature=0)
    assert state["answer"] == "ok"
    assert state.text() == "Q: why?\nA:ok\nDone."
    assert backend.batches == [["Q: why?\nA:"]]
    p = backend.params[0]
    assert (p.max_new_tokens, p.stop, p.temperature) == (7, ["\n"], 0)
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 2 and meta["finish_reason"]["type"] == "stop"
    assert "answer" in state and "nope" not in state


def test_run_defaults_are_inherited_and_overridden(backend):
    @sgl.function
    def prog(s):
        s += sgl.gen("a") + sgl.gen("b", max_tokens=3, temperature=0.5)

    prog.run(backend=backend, max_new_tokens=11, temperature=0.0, top_p=0.9)
    a, b = backend.params
    assert (a.max_new_tokens, a.temperature, a.top_p) == (11, 0.0, 0.9)
    assert (b.max_new_tokens, b.temperature, b.top_p) == (3, 0.5, 0.9)


def test_roles_use_chat_template_and_default_system(backend):
    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("reply"))
        with s.user():
            s += "More"
        s += sgl.assistant_begin() + sgl.gen("reply2") + sgl.assistant_end()

    state = chat.run(backend=backend)
    assert state.text() == (
        "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
        "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    )
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[2]["content"] == "ok"
    assert backend.batches[0] == ["<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def test_explicit_system_replaces_default(backend):
    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.") + sgl.user("Hi")

    assert chat.run(backend=backend).text().startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_nested_and_unbalanced_roles_are_errors(backend):
    @sgl.function
    def nested(s):
        s += sgl.user_begin() + sgl.assistant_begin()

    with pytest.raises(sgl.ProgramError, match="cannot nest"):
        nested.run(backend=backend)

    @sgl.function
    def unbalanced(s):
        s += sgl.user_end()

    with pytest.raises(sgl.ProgramError, match="without a matching"):
        unbalanced.run(backend=backend)


def test_select_picks_best_and_records_meta():
    backend = FakeBackend(prefs={"Paris": -0.1, "Rome": -0.5})

    @sgl.function
    def prog(s):
        s += "Capital: " + sgl.select("city", choices=["London", "Paris", "Rome"])

    state = prog.run(backend=backend)
    assert state["city"] == "Paris" and state.text() == "Capital: Paris"
    assert backend.scored == [("Capital: ", ["London", "Paris", "Rome"], False)]
    meta = state.get_meta_info("city")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-2.0, -0.1, -0.5])


def test_gen_with_choices_is_select_and_unconditional_method():
    backend = FakeBackend(prefs={"yes": -0.1, "no": -0.2})

    @sgl.function
    def prog(s):
        s += sgl.gen("a", choices=["yes", "no"]) + sgl.select("b", ["yes", "no"],
                                                             choices_method=sgl.unconditional_likelihood_normalized)

    state = prog.run(backend=backend)
    assert state["a"] == "yes" and state["b"] == "yes"
    assert [u for _, _, u in backend.scored] == [False, True]
    assert state.get_meta_info("b")["normalized_unconditional_prompt_logprobs"] == pytest.approx([0.9, 0.8])


@pytest.mark.parametrize("choices", [[], None, ["a", 3], ["a", ""], "ab"])
def test_bad_choices_raise_at_construction(choices):
    with pytest.raises(sgl.ProgramError, match="choices must be a non-empty list"):
        sgl.select("x", choices)
    if choices is not None:
        with pytest.raises(sgl.ProgramError, match="choices must be a non-empty list"):
            sgl.gen("x", choices=choices)


def test_choice_methods_directly():
    scores = [ChoiceScore("a b", [1, 2], [-0.1, -3.0]), ChoiceScore("a", [1], [-0.1]), ChoiceScore("c", [3], [-1.0])]
    # mean: -1.55, -0.1, -1.0 ; greedy: "a b" and "a" tie on token 0, then "a" (padded with its mean -0.1) wins
    assert sgl.token_length_normalized(["a b", "a", "c"], scores).decision == "a"
    assert sgl.greedy_token_selection(["a b", "a", "c"], scores).decision == "a"
    scores2 = [ChoiceScore("x", [1, 2], [-0.5, -0.2]), ChoiceScore("y", [3, 4], [-0.5, -0.4])]
    assert sgl.greedy_token_selection(["x", "y"], scores2).decision == "x"
    with pytest.raises(ValueError, match="unconditional"):
        sgl.unconditional_likelihood_normalized(["x", "y"], scores2)


def test_bad_gen_arguments():
    with pytest.raises(sgl.ProgramError, match="temperature"):
        sgl.gen("x", temperature=-1)
    with pytest.raises(sgl.ProgramError, match="at most one"):
        sgl.gen("x", regex="a+", json_schema={"type": "object"})
    with pytest.raises(sgl.ProgramError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(sgl.ProgramError, match="name"):
        sgl.gen(3)  # type: ignore[arg-type]
    assert isinstance(sgl.ProgramError("x"), InvalidRequestError)


def test_dtype_constrains_like_sglang_and_keeps_the_text():
    """SGLang's runtime endpoint: dtype -> its REGEX_* (replacing another regex), int/float also stop at
    space/newline, and the variable holds the generated text (not a parsed number)."""
    seen = []

    def responder(prompt, p):
        seen.append(p)
        return {REGEX_INT: "42 ", REGEX_FLOAT: "3.5"}.get(p.regex, '"ok"')

    backend = FakeBackend(responder=responder)

    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen_int("n") + " f=" + sgl.gen("f", dtype="float", regex="[a-z]+") + " s="
        s += sgl.gen_string("s") + " b=" + sgl.gen("b", dtype=bool)

    with pytest.warns(UserWarning, match="only dtype is used"):
        state = prog.run(backend=backend)
    assert state["n"] == "42 " and state["f"] == "3.5" and state["s"] == '"ok"'
    assert [p.regex for p in seen] == [REGEX_INT, REGEX_FLOAT, r'\"[\w\d\s]*\"', "(True|False)"]
    assert seen[0].stop[-2:] == [" ", "\n"] and seen[1].stop[-2:] == [" ", "\n"] and seen[2].stop == []


def test_unknown_variable_and_bad_appends(backend):
    @sgl.function
    def prog(s):
        s += sgl.gen("a")

    state = prog.run(backend=backend)
    with pytest.raises(sgl.UnknownVariableError, match=r"no variable 'b'.*defined: \['a'\]"):
        state["b"]
    with pytest.raises(KeyError):
        state.get_meta_info("b")

    @sgl.function
    def bad(s):
        s += 5

    with pytest.raises(sgl.ProgramError, match="convert it with str"):
        bad.run(backend=backend)


def test_wrong_argument_names(backend):
    @sgl.function
    def prog(s, question, n=1):
        s += question

    with pytest.raises(sgl.ProgramError, match=r"unknown argument\(s\) \['questoin'\].*\['question', 'n'\]"):
        prog.run(questoin="x", backend=backend)
    with pytest.raises(sgl.ProgramError, match="missing a required argument"):
        prog.run(backend=backend)
    with pytest.raises(sgl.ProgramError, match="unknown argument"):
        prog.run_batch([{"question": "a"}, {"q": "b"}], backend=backend)
    with pytest.raises(sgl.ProgramError, match="first parameter"):
        sgl.function(lambda: None)
    assert prog.run("positional", backend=backend).text() == "positional"
    assert prog.bind(question="bound").run(backend=backend).text() == "bound"


def test_fork_batches_branches_and_caches_prefix():
    backend = FakeBackend(responder=lambda prompt, p: prompt.rsplit("#", 1)[-1].strip())

    @sgl.function
    def prog(s):
        s += "Shared context. "
        forks = s.fork(3)
        forks += lambda i: f"branch #{i}" + sgl.gen("idea")
        for f in forks:
            f += "!" + sgl.gen("second")
        forks.join()
        s += "ideas: " + ", ".join(s["idea"])

    state = prog.run(backend=backend)
    assert backend.cached == ["Shared context. "]
    assert backend.batches[0] == [f"Shared context. branch #{i}" for i in range(3)]  # one batch
    assert len(backend.batches[1]) == 3  # the second gen of each branch: one batch too
    assert state["idea"] == ["0", "1", "2"]
    assert state["second"] == ["00!", "11!", "22!"]
    assert state.text() == "Shared context. ideas: 0, 1, 2"


def test_fork_join_concate_and_group_fork(backend):
    @sgl.function
    def prog(s):
        s += "P:"
        forks = s.fork(2)
        forks += lambda i: f" [{i}]"
        forks.join("concate_and_append")
        s += "|"
        mid = s.fork(2)
        grand = mid.fork(2)  # fork from a list of states: one flat group of 4
        grand += sgl.gen("leaf")
        grand.join()  # into each of the two `mid` states
        mid.join()  # and from those into s

    state = prog.run(backend=backend)
    assert state.text() == "P: [0] [1]|"
    assert state["leaf"] == [["ok", "ok"], ["ok", "ok"]]
    assert backend.batches[-1] == ["P: [0] [1]|"] * 4
    with pytest.raises(sgl.ProgramError, match="join mode"):
        sgl.ProgramStateGroup([]).join("bogus")


def test_fork_without_parent_cannot_join(backend):
    @sgl.function
    def prog(s):
        s += "x"

    state = prog.run(backend=backend)
    with pytest.raises(sgl.ProgramError, match="not created by fork"):
        sgl.ProgramStateGroup([state]).join()
    with pytest.raises(sgl.ProgramError, match="fork\\(size\\)"):
        state.fork(0)


def test_var_scope_and_set_var(backend):
    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "abc" + sgl.gen("g")
        s["manual"] = 3

    state = prog.run(backend=backend)
    assert state["block"] == "abcok" and state["manual"] == 3


def test_continue_a_finished_state(backend):
    @sgl.function
    def prog(s):
        s += "a"

    state = prog.run(backend=backend)
    state += sgl.gen("more")
    assert state["more"] == "ok" and state.text() == "aok"


def test_run_batch_order_prefix_and_errors(backend):
    @sgl.function
    def prog(s, q):
        s += "A long shared few-shot header that every item starts with.\n"
        s += "Q: " + q + "\nA:" + sgl.gen("a")

    states = prog.run_batch([{"q": str(i)} for i in range(10)], backend=backend, num_threads=4)
    assert [st.text() for st in states] == [f"A long shared few-shot header that every item starts with.\nQ: {i}\nA:ok"
                                            for i in range(10)]
    assert backend.cached == ["A long shared few-shot header that every item starts with.\nQ: "]
    backend.cached.clear()
    prog.run_batch([{"q": "1"}, {"q": "2"}], backend=backend, cache_prefix=False, num_threads=1)
    assert backend.cached == []
    with pytest.raises(sgl.StreamUsageError):
        prog.run_batch([{"q": "1"}], backend=backend, stream=True)
    with pytest.raises(sgl.ProgramError, match="list of dicts"):
        prog.run_batch(["q"], backend=backend)

    failing = FakeBackend(responder=lambda prompt, p: (_ for _ in ()).throw(InvalidRequestError("boom")))
    with pytest.raises(InvalidRequestError, match="boom"):
        prog.run_batch([{"q": "1"}, {"q": "2"}], backend=failing)


def test_streaming_text_iter_and_async(backend):
    slow = FakeBackend(responder=lambda prompt, p: "streamed words")

    @sgl.function
    def prog(s):
        s += "Start:" + sgl.gen("x") + " end"

    state = prog.run(stream=True, backend=slow)
    chunks = list(state.text_iter())
    assert len(chunks) >= 2 and "".join(chunks) == "Start:streamed words end"
    assert state["x"] == "streamed words"

    state2 = prog.run(stream=True, backend=slow)
    assert "".join(state2.text_iter("x")) == "streamed words"

    async def consume():
        st = prog.run(stream=True, backend=slow)
        return [c async for c in st.text_async_iter()]

    assert "".join(asyncio.run(consume())) == "Start:streamed words end"

    finished = prog.run(backend=slow)
    with pytest.raises(sgl.StreamUsageError, match="stream=True"):
        finished.text_iter()
    with pytest.raises(sgl.StreamUsageError):
        finished.text_async_iter()

    state3 = prog.run(stream=True, backend=slow)
    with pytest.raises(sgl.UnknownVariableError):
        list(state3.text_iter("missing"))


def test_streaming_error_surfaces(backend):
    @sgl.function
    def prog(s):
        s += "a"
        s["nope"]

    state = prog.run(stream=True, backend=backend)
    with pytest.raises(sgl.UnknownVariableError):
        list(state.text_iter())
    assert isinstance(state.error(), sgl.UnknownVariableError)
    with pytest.raises(sgl.UnknownVariableError):
        state.text()


def test_trace_graph_and_constant_prefix(backend):
    @sgl.function
    def prog(s, question):
        s += sgl.system("You judge answers.")
        s += sgl.user("Question: " + question)
        forks = s.fork(2)
        forks += sgl.assistant(sgl.gen("verdict", max_tokens=4))
        forks.join()

    graph = prog.trace()
    kinds = [type(n).__name__ for n in graph.nodes]
    assert kinds[:7] == ["SglRoleBegin", "SglConstantText", "SglRoleEnd", "SglRoleBegin", "SglConstantText",
                         "SglArgument", "SglRoleEnd"]
    assert "SglFork" in kinds and kinds[-1] == "SglJoin" and len(graph.children) == 2
    assert any(type(n).__name__ == "SglGen" for n in graph.children[0].nodes)
    assert "fork child 1" in graph.graph_str()

    compiled = prog.compile(backend=backend)
    assert compiled.prefix == "<|im_start|>system\nYou judge answers.<|im_end|>\n<|im_start|>user\nQuestion: "
    compiled.run_batch([{"question": "a"}, {"question": "b"}])
    assert backend.cached[0] == compiled.prefix

    # A program that formats its argument: tracing stops there, the prefix stays before it.
    @sgl.function
    def fmt(s, question):
        s += "Header. "
        s += f"Q: {question}"
        s += sgl.gen("a")

    traced = fmt.trace()
    assert traced.stopped and "question" in traced.stopped
    assert fmt.compile(backend=backend).prefix == "Header. "
    assert [type(n).__name__ for n in fmt.trace(question="given").nodes] == ["SglConstantText", "SglConstantText", "SglGen"]
    with pytest.raises(sgl.ProgramError, match="unknown argument"):
        fmt.trace(qestion="x")


def test_trace_stops_on_control_flow(backend):
    @sgl.function
    def agent(s):
        s += "Think:" + sgl.gen("action")
        if s["action"] == "stop":
            s += "bye"

    traced = agent.trace()
    assert "comparison" in traced.stopped


def test_image_and_backend_errors():
    with pytest.raises(sgl.UnsupportedFeatureError, match="text-only"):
        sgl.image("cat.png")
    with pytest.raises(sgl.ProgramError, match="BaseBackend"):
        sgl.set_default_backend("http://localhost")  # type: ignore[arg-type]


def test_default_backend(backend):
    sgl.set_default_backend(backend)
    try:
        @sgl.function
        def prog(s):
            s += sgl.gen("a")

        assert prog()["a"] == "ok"
        assert sgl.get_default_backend() is backend
    finally:
        sgl.global_config.default_backend = None


def test_streamed_variable_is_readable_before_the_program_ends():
    gate = threading.Event()

    def responder(prompt, params):
        if prompt.endswith("B:"):
            assert gate.wait(10)
        return "v"

    @sgl.function
    def prog(s):
        s += "A:" + sgl.gen("a") + " B:" + sgl.gen("b")

    state = prog.run(stream=True, backend=FakeBackend(responder))
    assert state["a"] == "v"  # while gen "b" is still blocked
    assert not state._run.done.is_set()
    gate.set()
    assert state["b"] == "v" and state.text() == "A:v B:v"
