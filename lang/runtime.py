"""SGLang's `sgl.Runtime` (a local server process) and `sgl.Engine` (in-process, offline) over radix-backend.

`Runtime(model_path=...)` starts `python -m radix_backend.server` on a free loopback port, waits
until it answers, and talks to it through `.endpoint` (a RuntimeEndpoint), so
`sgl.set_default_backend(runtime)` works as in SGLang. `Engine(model_path=...)` is the process's
radix engine behind SGLang's offline API: `generate(prompt, sampling_params)` takes SGLang's
sampling dicts and returns SGLang-shaped dicts.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from radix_backend.engine import Engine as RadixEngine
from radix_backend.outputs import GenerateOutput
from radix_backend.sglang_meta import finished_meta, LogprobOptions, StreamMeta
from radix_backend.sampling_params import sglang_sampling_params

from .backends.runtime_endpoint import RuntimeEndpoint
from .errors import UnsupportedFeatureError


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Runtime:
    """A radix-backend server in a child process (SGLang's `sgl.Runtime`); `shutdown()` stops it.

    Keyword arguments become server flags (`kv_cache_tokens=4096` -> `--kv-cache-tokens 4096`;
    `True` -> a bare flag), as SGLang's ServerArgs keywords do.
    """

    def __init__(self, model_path: str | None = None, *, host: str = "127.0.0.1", port: int | None = None,
                 log_level: str = "error", launch_timeout: float = 300.0, **server_args: Any) -> None:
        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        cmd = [sys.executable, "-m", "radix_backend.server", "--host", host, "--port", str(self.port),
               "--log-level", log_level]
        if model_path is not None:
            cmd += ["--model", str(model_path)]
        for key, value in server_args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value not in (None, False):
                cmd += [flag, str(value)]
        self.process = subprocess.Popen(cmd)
        try:
            self._wait_ready(launch_timeout)
            self.endpoint = RuntimeEndpoint(self.url)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the radix-backend server exited with code {self.process.returncode} while "
                                   "starting; see its output above")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the radix-backend server did not answer on {self.url} within {timeout:.0f} s")

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                 **kwargs: Any) -> Any:
        """POST /generate as SGLang's Runtime.generate does; returns the parsed JSON."""
        return self.endpoint._generate({"text": prompt, "sampling_params": sampling_params or {}, **kwargs})

    def shutdown(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class Engine:
    """SGLang's offline `sgl.Engine` API on a radix engine in this process."""

    def __init__(self, model_path: str | None = None, **engine_args: Any) -> None:
        self.engine = RadixEngine(model_path, **engine_args)

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None, *,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False) -> Any:
        """One prompt -> one dict {"text", "output_ids", "meta_info"}; a list -> a list of them (n samples each
        when sampling_params has n). `stream=True` (one prompt) yields dicts with the text so far."""
        batched = isinstance(prompt, list) or (bool(input_ids) and isinstance(input_ids[0], list))
        items = (prompt if isinstance(prompt, list) else input_ids) if batched else [prompt if prompt is not None
                                                                                     else input_ids]
        raw = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if stream:
            if batched:
                raise UnsupportedFeatureError("Engine.generate(stream=True) takes one prompt")
            return self._stream(items[0], sglang_sampling_params(raw[0])[0], is_ids=prompt is None)
        prompts, params = [], []
        for item, sp in zip(items, raw):
            p, n = sglang_sampling_params(sp)
            prompts += [item] * n
            params += [p] * n
        key = "input_ids" if prompt is None else "prompt"
        outs = self.engine.generate(**{key: prompts}, params=params)
        results = [_as_dict(o) for o in outs]
        return results if batched or len(results) > 1 else results[0]

    def _stream(self, item: Any, params: Any, is_ids: bool) -> Iterator[dict[str, Any]]:
        text, ids = "", []
        kwargs = {"input_ids": item} if is_ids else {"prompt": item}
        meta = StreamMeta("", LogprobOptions())
        for chunk in self.engine.stream(params=params, **kwargs):
            text += chunk.text
            ids += chunk.token_ids
            yield {"text": text, "output_ids": list(ids), "meta_info": meta.update(chunk)}

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _as_dict(out: GenerateOutput) -> dict[str, Any]:
    return {"text": out.text, "output_ids": list(out.token_ids),
            "meta_info": finished_meta(out, out.request_id, LogprobOptions())}
