"""RuntimeEndpoint: run DSL programs against a server's SGLang-native HTTP API
(`radix-backend serve`, or an SGLang runtime), cf. sglang.lang.backend.runtime_endpoint.

Protocol: POST /generate with `text` (str or list = one batch), `sampling_params` (SGLang's dict:
max_new_tokens, temperature, stop, regex, json_schema, ...), `stream`, `return_logprob`,
`logprob_start_len`, `return_text_in_logprobs`; the reply has `text` and `meta_info`. Streaming
replies are server-sent events carrying the cumulative text. Needs httpx (`[server]` extra).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from radix_backend.errors import (ConstraintError, EngineShutdownError, InvalidRequestError, MissingDependencyError,
                                  PromptTooLongError, RadixBackendError)
from radix_backend.outputs import ChoiceScore, GenerateOutput, StreamChunk, TokenLogprob
from radix_backend.sampling_params import SamplingParams, to_sglang_sampling_params
from radix_backend.sglang_meta import finish_from_sglang, output_from_sglang

from ..chat_template import ChatTemplate, chatml, from_renderer
from .base import BaseBackend

logger = logging.getLogger(__name__)

class RuntimeEndpointError(RadixBackendError, ConnectionError):
    """The server could not be reached or answered with a server-side failure."""


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0,
                 chat_template: ChatTemplate | None = None) -> None:
        try:
            import httpx
        except ImportError as exc:
            raise MissingDependencyError.for_extra("httpx", "server") from exc
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)
        self._chat_template = chat_template
        self.model_info = self._get("/get_model_info")

    # ---- HTTP --------------------------------------------------------------------------------
    def _check(self, resp: Any) -> None:
        if resp.status_code < 400:
            return
        try:
            message = resp.json()["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error body
            message = resp.text
        code = ""
        try:
            code = str(resp.json()["error"].get("code", ""))
        except Exception:  # noqa: BLE001
            pass
        if resp.status_code == 400:
            if code == "context_length_exceeded":
                raise PromptTooLongError(message)
            if code == "invalid_constraint":
                raise ConstraintError(message)
            raise InvalidRequestError(message)
        if resp.status_code == 503:
            raise EngineShutdownError(message)
        raise RuntimeEndpointError(f"{self.base_url} answered {resp.status_code}: {message}")

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            resp = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RuntimeEndpointError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        self._check(resp)
        return resp

    def _get(self, path: str) -> Any:
        return self._request("GET", path).json()

    def _generate(self, data: dict[str, Any]) -> Any:
        return self._request("POST", "/generate", json=data).json()

    # ---- BaseBackend ---------------------------------------------------------------------------
    def get_model_name(self) -> str:
        return str(self.model_info["model_path"])

    def get_chat_template(self) -> ChatTemplate:
        """The served model's own template (its tokenizer, when the checkpoint is readable here), else ChatML."""
        if self._chat_template is None:
            self._chat_template = self._template_from_checkpoint()
        return self._chat_template

    def _template_from_checkpoint(self) -> ChatTemplate:
        served = self._template_from_server()
        if served is not None:
            return served
        try:
            from radix_backend.model_executor.loader import load_tokenizer, resolve_checkpoint

            tok = load_tokenizer(resolve_checkpoint(self.model_info.get("model_path")))
            if tok.chat_template:
                return from_renderer(
                    lambda msgs, gen: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen),
                    name=str(self.model_info.get("served_model_name") or "server"),
                )
        except Exception as exc:  # noqa: BLE001 - the checkpoint may live on another machine
            logger.warning("RuntimeEndpoint: cannot read the served model's chat template (%s); using ChatML", exc)
        return chatml()

    def _template_from_server(self) -> ChatTemplate | None:
        """The Jinja template our server reports in /get_model_info, rendered here as its tokenizer would."""
        template = self.model_info.get("chat_template")
        if not isinstance(template, str):
            return None
        from transformers.utils.chat_template_utils import render_jinja_template

        specials = self.model_info.get("special_tokens") or {}

        def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                                add_generation_prompt=generation_prompt, **specials)
            return rendered[0]

        return from_renderer(render, name=str(self.model_info.get("served_model_name") or "server"))

    def generate(self, prompts: list[str], params: list[SamplingParams]) -> list[GenerateOutput]:
        data = {"text": list(prompts), "sampling_params": [to_sglang_sampling_params(p) for p in params]}
        want_lp = [p.logprobs for p in params]
        if any(want_lp):
            data["return_logprob"] = want_lp
            data["top_logprobs_num"] = [p.top_logprobs for p in params]
        objs = self._generate(data)
        return [output_from_sglang(o) for o in (objs if isinstance(objs, list) else [objs])]

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[StreamChunk]:
        """Incremental events (text, ids and, when asked, logprobs of each chunk's tokens)."""
        import httpx

        data = {"text": prompt, "sampling_params": to_sglang_sampling_params(params), "stream": True,
                "incremental_streaming_output": True}
        if params.logprobs:
            data.update(return_logprob=True, top_logprobs_num=params.top_logprobs)
        try:
            with self._client.stream("POST", "/generate", json=data) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._check(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        raise InvalidRequestError(obj["error"].get("message", str(obj["error"])))
                    meta = obj.get("meta_info", {})
                    reason = finish_from_sglang(meta)[0] if meta.get("finish_reason") else None
                    final = output_from_sglang(obj) if reason else None
                    lps = meta.get("output_token_logprobs")
                    yield StreamChunk(text=obj.get("text", ""), token_ids=list(obj.get("output_ids") or []),
                                      finish_reason=reason,  # type: ignore[arg-type]
                                      meta=final.meta if final else None,
                                      logprobs=[TokenLogprob(token_id=e[1], logprob=e[0]) for e in lps]
                                      if lps is not None else None)
        except httpx.HTTPError as exc:
            raise RuntimeEndpointError(f"stream from {self.base_url} failed: {exc}") from exc

    def prompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        obj = self._generate({"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                              "logprob_start_len": start})
        return [(e[0], e[1]) for e in obj["meta_info"]["input_token_logprobs"]]

    def token_texts(self, token_ids: list[int]) -> list[str]:
        if not token_ids:
            return []
        obj = self._generate({"input_ids": list(token_ids), "sampling_params": {"max_new_tokens": 0},
                              "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True})
        return [e[2] for e in obj["meta_info"]["input_token_logprobs"]]

    def cache_prefix(self, prefix: str) -> None:
        self._generate({"text": prefix, "sampling_params": {"max_new_tokens": 0}})

    def score(self, prefix: str, continuations: list[str], *, unconditional: bool = False) -> list[ChoiceScore]:
        """Choice logprobs from `input_token_logprobs` of prefix+choice, the prefix cached first.

        Like Engine.score, the choice's tokens start where prefix+choice tokenizes differently
        from the prefix alone, so a token merged across the boundary is scored as part of the choice.
        """
        first = self._generate({"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        start = max(int(first["meta_info"]["prompt_tokens"]) - 1, 0)
        texts = [prefix] + [prefix + c for c in continuations]
        objs = self._generate({"text": texts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                               "logprob_start_len": start, "return_text_in_logprobs": True})
        prefix_tail = objs[0]["meta_info"]["input_token_logprobs"]  # the prefix's last token
        scores = []
        for c, obj in zip(continuations, objs[1:]):
            entries = obj["meta_info"]["input_token_logprobs"]
            if prefix_tail and entries and entries[0][1] == prefix_tail[0][1]:
                entries = entries[1:]
            if not entries:
                raise InvalidRequestError(f"choice {c!r} adds no tokens to the prefix")
            scores.append(ChoiceScore(text=c, token_ids=[e[1] for e in entries],
                                      token_logprobs=[0.0 if e[0] is None else float(e[0]) for e in entries]))
        if unconditional:
            objs = self._generate({"input_ids": [s.token_ids for s in scores], "sampling_params": {"max_new_tokens": 0},
                                   "return_logprob": True, "logprob_start_len": 0})
            for s, obj in zip(scores, objs if isinstance(objs, list) else [objs]):
                s.unconditional_logprobs = [0.0 if e[0] is None else float(e[0])
                                            for e in obj["meta_info"]["input_token_logprobs"]]
        return scores

    def flush_cache(self) -> bool:
        import httpx

        try:
            return self._client.post("/flush_cache").status_code == 200
        except httpx.HTTPError as exc:
            raise RuntimeEndpointError(f"cannot reach {self.base_url}/flush_cache: {exc}") from exc

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        self._client.close()
