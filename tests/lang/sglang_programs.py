"""SGLang frontend programs as their users write them (`import sglang as sgl`), for the compat tests.

`build()` imports `sglang` when called, so the same source runs on SGLang's own package (its
RuntimeEndpoint against our server) or on `sys.modules["sglang"] = radix_backend.lang`. The
programs use no chat roles: SGLang's client picks its own template from the model name, our
in-process backend uses the model's, and plain text keeps the two runs comparable.
"""

from __future__ import annotations

from typing import Any

STOP_REGEX = r"[a-z]{3}"  # the first word of three or more letters ends the generation
QUESTION = "Question: which is bigger, an elephant or a mouse? Answer:"


def build() -> dict[str, Any]:
    import sglang as sgl

    @sgl.function
    def stop_at_regex(s):
        s += "A list of animals: cat, dog," + sgl.gen("animals", max_tokens=32, stop_regex=STOP_REGEX)

    @sgl.function
    def at_least(s):
        s += QUESTION + sgl.gen("answer", max_tokens=16, min_tokens=8, stop=[" "])

    @sgl.function
    def typed(s):
        s += "The year the Berlin wall fell: " + sgl.gen_int("year", max_tokens=6) + "\n"
        s += "Is water wet (True or False)? " + sgl.gen("wet", dtype=bool, max_tokens=4) + "\n"
        s += "A name in quotes: " + sgl.gen("name", dtype=str, max_tokens=12) + "\n"
        s += "Code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", max_tokens=10)

    @sgl.function
    def choose(s):
        s += QUESTION + " The " + sgl.select("pick", choices=["elephant", "mouse"])

    @sgl.function
    def branches(s, topic):
        s += f"Two facts about {topic}.\n"
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=10, stop="\n")
        forks.join()

    @sgl.function
    def streamed(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=12, return_logprob=True)

    @sgl.function
    def short(s, word):
        s += f"The word {word} means" + sgl.gen("meaning", max_tokens=8, stop="\n")

    @sgl.function
    def logprobs(s):
        s += "The quick brown fox" + sgl.gen("full", max_tokens=4, return_logprob=True, top_logprobs_num=2,
                                             logprob_start_len=2, return_text_in_logprobs=True)
        s += " and" + sgl.gen("plain", max_tokens=3) + sgl.gen("short", max_tokens=2, return_logprob=True)

    @sgl.function
    def choose_each_way(s):  # (SGLang 0.5.23's client cannot run unconditional_likelihood_normalized against
        s += QUESTION        # a server that follows its own: input logprobs start at the end for start -1)
        for i, method in enumerate((sgl.token_length_normalized, sgl.greedy_token_selection)):
            s += f" {i}." + sgl.select(f"pick{i}", choices=["elephant", "mouse"], choices_method=method)

    return {"stop_at_regex": stop_at_regex, "at_least": at_least, "typed": typed, "choose": choose,
            "branches": branches, "streamed": streamed, "short": short, "logprobs": logprobs,
            "choose_each_way": choose_each_way}


async def run_all_async(progs: dict[str, Any]) -> dict[str, Any]:
    """`run_all` with run_async and run_batch_async (radix_backend.lang only: SGLang has neither)."""
    out: dict[str, Any] = {}
    st = await progs["stop_at_regex"].run_async(temperature=0)
    out["animals"], out["animals_meta"] = st["animals"], st.get_meta_info("animals")
    st = await progs["at_least"].run_async(temperature=0)
    out["answer"], out["answer_meta"] = st["answer"], st.get_meta_info("answer")
    st = await progs["typed"].run_async(temperature=0)
    out.update({k: st[k] for k in ("year", "wet", "name", "code")})
    out["pick"] = (await progs["choose"].run_async(temperature=0))["pick"]
    out["fact"] = (await progs["branches"].run_async(topic="the moon", temperature=0))["fact"]
    states = await progs["short"].run_batch_async([{"word": w} for w in ("river", "stone", "cloud")], temperature=0)
    out["meanings"] = [s["meaning"] for s in states]
    return out


def meta_keys(progs: dict[str, Any]) -> dict[str, Any]:
    """The meta_info keys each kind of gen and select reports: non-streamed (with and without
    logprobs, prompt logprobs and token texts), each select method, and a streamed gen's pieces
    (`text_async_iter(return_meta_data=True)`) and final meta_info."""
    import asyncio

    keys: dict[str, Any] = {}
    st = progs["logprobs"].run(temperature=0)
    keys.update({name: sorted(st.get_meta_info(name)) for name in ("full", "plain", "short")})
    st = progs["choose_each_way"].run(temperature=0)
    keys.update({f"pick{i}": sorted(st.get_meta_info(f"pick{i}")) for i in range(2)})
    state = progs["streamed"].run(stream=True, temperature=0, return_logprob=True)

    async def pieces() -> list[Any]:
        return [meta async for _, meta in state.text_async_iter("story", return_meta_data=True)]

    metas = asyncio.run(pieces())
    keys["stream_pieces"] = sorted({k for m in metas for k in m})
    keys["stream_final"] = sorted(state.get_meta_info("story"))
    return keys


def run_all(progs: dict[str, Any]) -> dict[str, Any]:
    """Run every non-streamed program greedily; the variables and meta data the tests check."""
    out: dict[str, Any] = {}
    st = progs["stop_at_regex"].run(temperature=0)
    out["animals"], out["animals_meta"] = st["animals"], st.get_meta_info("animals")
    st = progs["at_least"].run(temperature=0)
    out["answer"], out["answer_meta"] = st["answer"], st.get_meta_info("answer")
    st = progs["typed"].run(temperature=0)
    out.update({k: st[k] for k in ("year", "wet", "name", "code")})
    out["pick"] = progs["choose"].run(temperature=0)["pick"]
    out["fact"] = progs["branches"].run(topic="the moon", temperature=0)["fact"]
    states = progs["short"].run_batch([{"word": w} for w in ("river", "stone", "cloud")], temperature=0)
    out["meanings"] = [s["meaning"] for s in states]
    return out
