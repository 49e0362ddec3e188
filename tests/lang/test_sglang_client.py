"""SGLang's own frontend and client (sglang==0.5.23 from PyPI) against our server, on SmolLM2.

The wheel is installed `--no-deps` into a cache folder with the two small pure-Python packages its
client imports (msgspec, pybase64); `sglang.srt.utils` (torch/triton/zmq, only for SGLang's own
server) is stubbed, nothing in `sglang.lang` is. Without network access to PyPI the SGLang half
skips with the reason, and the same programs still run through `radix_backend.lang` as `sglang`.
Assertions are about structure, constraints and protocol, not what the 135M model knows.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import radix_backend.lang as radix_lang
from sglang_programs import QUESTION, STOP_REGEX, build, meta_keys, run_all, run_all_async

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

SGLANG = "sglang==0.5.23"
CLIENT_DEPS = ("msgspec", "pybase64")


def _install_sglang() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "radix-backend-tests" / "sglang-0.5.23"
    if (cache / ".complete").exists():
        return cache
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--retries", "1", "--timeout", "30",
           "--target", str(cache), SGLANG, *CLIENT_DEPS]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.skip(f"cannot install {SGLANG} --no-deps from PyPI here: {result.stderr.strip()[-300:]}")
    (cache / ".complete").touch()
    return cache


def _swap_sglang(module: types.ModuleType | None) -> dict[str, types.ModuleType]:
    """Remove every sglang module from sys.modules (returned) and install `module` as `sglang`."""
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    if module is not None:
        sys.modules["sglang"] = module
    return saved


@pytest.fixture(scope="module")
def real_sglang():
    target = _install_sglang()
    utils = types.ModuleType("sglang.srt.utils")  # SGLang's server utilities: torch, triton, zmq
    utils.__path__ = []
    patches = types.ModuleType("sglang.srt.utils.hf_transformers_patches")
    patches.apply_all = lambda: None
    stubs = {"sglang.srt.utils": utils, "sglang.srt.utils.hf_transformers_patches": patches}
    if "IPython" not in sys.modules:
        try:
            import IPython.display  # noqa: F401  (sglang.utils imports it for notebooks)
        except ImportError:
            display = types.ModuleType("IPython.display")
            display.HTML, display.display = object, print
            stubs.update({"IPython": types.ModuleType("IPython"), "IPython.display": display})
    saved = _swap_sglang(None)
    sys.path.insert(0, str(target))
    sys.modules.update(stubs)
    try:
        import sglang

        assert sglang.__version__ == "0.5.23" and Path(sglang.__file__).is_relative_to(target)
        assert not any(m == "torch.cuda" for m in sys.modules if m.startswith("sglang"))
        yield sglang
    finally:
        sys.path.remove(str(target))
        _swap_sglang(None)
        for k in stubs:
            sys.modules.pop(k, None)
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def server_url(engine):
    from radix_backend.server import ServerThread, create_app

    with ServerThread(create_app(engine)) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def through_sglang(real_sglang, server_url):
    """The programs run by SGLang's interpreter and RuntimeEndpoint against our server."""
    backend = real_sglang.RuntimeEndpoint(server_url)
    real_sglang.set_default_backend(backend)
    try:
        progs = build()
        assert progs["typed"].__class__.__module__ == "sglang.lang.ir"  # really SGLang's SglFunction
        yield progs, run_all(progs)
    finally:
        real_sglang.global_config.default_backend = None


@pytest.fixture(scope="module")
def through_radix(engine):
    """The same program source with `sglang` being radix_backend.lang, in process."""
    saved = _swap_sglang(radix_lang)
    radix_lang.set_default_backend(radix_lang.RadixEngineBackend(engine))
    try:
        progs = build()
        results = run_all(progs)
        results_async = asyncio.run(run_all_async(progs))
    finally:
        radix_lang.global_config.default_backend = None
        _swap_sglang(None)
        sys.modules.update(saved)  # SGLang's own modules back, for the tests that use them
    return progs, results, engine, results_async


def _check_structure(out: dict) -> None:
    assert out["animals_meta"]["finish_reason"]["type"] == "stop"
    assert re.search(STOP_REGEX, out["animals"]), out["animals"]
    assert out["answer_meta"]["completion_tokens"] >= 8  # min_tokens: the stop " " is ignored until then
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", out["year"])
    assert out["wet"] in ("True", "False")
    assert re.fullmatch(r"\"[\w\d\s]*\"", out["name"])
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", out["code"])
    assert out["pick"] in ("elephant", "mouse")
    assert isinstance(out["fact"], list) and len(out["fact"]) == 2 and all(isinstance(f, str) for f in out["fact"])
    assert len(out["meanings"]) == 3 and all("\n" not in m for m in out["meanings"])


def test_sglang_client_runs_the_programs_against_our_server(through_sglang):
    _check_structure(through_sglang[1])


def test_the_same_source_runs_on_radix_lang_as_sglang(through_radix):
    _check_structure(through_radix[1])


def test_radix_lang_gives_the_same_variables_as_sglang_through_the_server(through_sglang, through_radix):
    """The same variables from SGLang's client against our server, from `run` in process and from
    `run_async` / `run_batch_async` in process."""
    ours, ours_async, theirs = through_radix[1], through_radix[3], through_sglang[1]
    for key in ("animals", "answer", "year", "wet", "name", "code", "pick", "fact", "meanings"):
        assert ours[key] == theirs[key], key
        assert ours_async[key] == theirs[key], key


def test_meta_info_keys_are_the_same_in_process_and_through_sglangs_client(through_sglang, through_radix):
    """Every meta_info key SGLang's client hands a program from our server, the in-process backend
    reports too, and no other: gen with and without logprobs, select by each method, streaming."""
    theirs = meta_keys(through_sglang[0])
    saved = _swap_sglang(radix_lang)
    radix_lang.set_default_backend(radix_lang.RadixEngineBackend(through_radix[2]))
    try:
        ours = meta_keys(through_radix[0])
    finally:
        radix_lang.global_config.default_backend = None
        _swap_sglang(None)
        sys.modules.update(saved)
    assert "output_token_logprobs_length" in theirs["stream_pieces"] and "e2e_latency" in theirs["stream_final"]
    assert {"input_token_logprobs", "input_top_logprobs", "output_top_logprobs"} <= set(theirs["full"])
    assert "greedy_logprob_matrix" in theirs["pick1"]
    assert ours == theirs


def test_sglang_streams_with_logprobs_from_our_server(through_sglang):
    progs = through_sglang[0]
    state = progs["streamed"].run(stream=True, temperature=0, return_logprob=True)

    async def collect():
        return [item async for item in state.text_async_iter("story", return_meta_data=True)]

    pieces = asyncio.run(collect())
    assert "".join(chunk for chunk, _ in pieces) == state["story"]
    last = pieces[-1][1]
    assert last["completion_tokens"] == last["output_token_logprobs_length"] == len(last["output_token_logprobs"])
    assert all(len(entry) == 3 and entry[0] <= 0 for entry in last["output_token_logprobs"])


def test_sglang_client_info_calls(real_sglang, server_url, engine):
    backend = real_sglang.RuntimeEndpoint(server_url)
    assert backend.get_model_name() == engine.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert backend.get_server_info()["context_length"] == engine.context_length
    backend.flush_cache()
    assert QUESTION  # the programs module imported


def test_sglang_concatenate_and_append_fails_fast(real_sglang, server_url):
    backend = real_sglang.RuntimeEndpoint(server_url)
    with pytest.raises(RuntimeError, match="not supported"):
        backend.concatenate_and_append(["a"], "b")
