"""SGLang's `sgl.Runtime` (a local server process) and `sgl.Engine` (offline API) over radix-backend."""

from __future__ import annotations

import pytest

import radix_backend.lang as sgl
from radix_backend import InvalidRequestError

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


@pytest.mark.timeout(300)
def test_runtime_starts_a_server_process_that_programs_run_on(tiny_llama_dir):
    with sgl.Runtime(model_path=str(tiny_llama_dir), kv_cache_tokens=2048, device="cpu") as runtime:
        assert runtime.process.poll() is None
        out = runtime.generate("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 3

        @sgl.function
        def prog(s):
            s += "Hi" + sgl.gen("a", max_tokens=4, ignore_eos=True)

        sgl.set_default_backend(runtime)  # as in SGLang: a Runtime stands for its endpoint
        try:
            state = prog.run(temperature=0)
            assert state.get_meta_info("a")["completion_tokens"] == 4
        finally:
            sgl.global_config.default_backend = None
        process = runtime.process
    assert process.poll() is not None  # shut down on exit


def test_runtime_that_cannot_start_raises_instead_of_hanging(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code"):
        sgl.Runtime(model_path=str(tmp_path / "missing"), launch_timeout=120)


def test_engine_speaks_sglangs_offline_api(tiny_llama_dir):
    with sgl.Engine(str(tiny_llama_dir), kv_cache_tokens=2048, device="cpu") as llm:
        one = llm.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert set(one) == {"text", "output_ids", "meta_info"} and one["meta_info"]["completion_tokens"] == 4
        many = llm.generate(["a", "b"], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True, "n": 2})
        assert len(many) == 4 and all(len(o["output_ids"]) == 2 for o in many)
        streamed = list(llm.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                                     stream=True))
        assert streamed[-1]["text"] == one["text"] and streamed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        with pytest.raises(InvalidRequestError, match="beam search"):
            llm.generate("x", {"beam_width": 2})
