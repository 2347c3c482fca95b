"""An OpenAI-compatible HTTP server (the API vLLM users already use), on the standard library.

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with SSE
streaming), GET /metrics (Prometheus text). Bad requests get a 4xx with an OpenAI-style error body
and the server goes on serving. Binds 127.0.0.1 unless told otherwise; an optional API key is
checked as `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dist_glm5.sampling.params import SamplingParams

from .engine_loop import EngineLoop

log = logging.getLogger(__name__)

SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "ignore_eos",
}
COMMON_KEYS = {"model", "max_tokens", "stream", "stream_options", "n", "user"} | SAMPLING_KEYS
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "prompt_logprobs", "echo"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


def simple_chat_template(messages: list[dict]) -> str:
    """The embedded model's template (its tokenizer has none): role tags and an open assistant
    turn."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class App:
    def __init__(
        self,
        loop: EngineLoop,
        tokenizer,
        model_name: str,
        max_model_len: int,
        chat_template: str | None,
        api_key: str | None,
        stage_names: list[str],
    ):
        self.loop, self.tok, self.model_name = loop, tokenizer, model_name
        self.max_model_len, self.api_key = max_model_len, api_key
        self.chat_template = chat_template
        self.stage_names = stage_names
        self.started = time.time()

    # ---- request -> prompt ids and params ------------------------------------------------
    def params(self, body: dict, allowed: set[str], chat: bool) -> tuple[SamplingParams, dict]:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise RequestError(400, f"unrecognized request argument supplied: {', '.join(unknown)}")
        if body.get("model") not in (None, self.model_name):
            raise RequestError(
                404,
                f"the model {body['model']!r} does not exist; this server serves "
                f"{self.model_name!r}",
                "model_not_found",
            )
        if body.get("n", 1) != 1:
            raise RequestError(400, "n must be 1")
        max_tokens = body.get(
            "max_completion_tokens", body.get("max_tokens", 16 if not chat else 256)
        )
        if max_tokens is None:
            max_tokens = 256
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise RequestError(400, f"max_tokens={max_tokens!r} must be a non-negative integer")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if chat:
            lp = body.get("top_logprobs", 0) if body.get("logprobs") else None
        else:
            lp = body.get("logprobs")
        kw = {
            k: body[k]
            for k in ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos")
            if body.get(k) is not None
        }
        try:
            p = SamplingParams(
                max_tokens=max_tokens,
                stop=stop,
                stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                logit_bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()},
                bad_words=tuple(self._bad_words(body.get("bad_words") or ())),
                logprobs=lp,
                prompt_logprobs=body.get("prompt_logprobs"),
                **kw,
            )
        except (ValueError, TypeError) as e:
            raise RequestError(400, str(e)) from None
        return p, body

    def _bad_words(self, words):
        for w in words:
            if isinstance(w, str):
                if self.tok is None:
                    raise RequestError(
                        400, "bad_words as text need a tokenizer; give token id lists"
                    )
                yield self.tok.encode(w)
            else:
                yield list(w)

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(isinstance(m, dict) and "role" in m for m in msgs)
            ):
                raise RequestError(
                    400, "messages must be a non-empty list of {role, content} objects"
                )
            if self.tok is None:
                raise RequestError(
                    400, "this model has no tokenizer: use /v1/completions with token ids"
                )
            if self.chat_template:
                from jinja2 import Template

                text = Template(self.chat_template).render(
                    messages=msgs, add_generation_prompt=True
                )
            else:
                text = simple_chat_template(msgs)
            return self.tok.encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tok is None:
                raise RequestError(
                    400, "this model has no tokenizer: give the prompt as a list of token ids"
                )
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError(400, "prompt must be a string or a non-empty list of token ids")

    def check_len(self, ids: list[int], p: SamplingParams) -> None:
        if len(ids) + p.max_tokens > self.max_model_len:
            raise RequestError(
                400,
                f"prompt of {len(ids)} tokens plus max_tokens={p.max_tokens} exceeds the planned "
                f"context of {self.max_model_len} tokens",
            )

    # ---- metrics ------------------------------------------------------------------------
    def metrics(self) -> str:
        m, st = self.loop.metrics, self.loop.c.stats
        lines = [
            "# TYPE dist_glm5_requests_total counter",
            f"dist_glm5_requests_total {m['requests']}",
            "# TYPE dist_glm5_requests_failed_total counter",
            f"dist_glm5_requests_failed_total {m['requests_failed']}",
            "# TYPE dist_glm5_prompt_tokens_total counter",
            f"dist_glm5_prompt_tokens_total {m['prompt_tokens']}",
            "# TYPE dist_glm5_completion_tokens_total counter",
            f"dist_glm5_completion_tokens_total {m['completion_tokens']}",
            "# TYPE dist_glm5_time_to_first_token_seconds summary",
            f"dist_glm5_time_to_first_token_seconds_sum {m['ttft_sum']:.6f}",
            f"dist_glm5_time_to_first_token_seconds_count {m['ttft_count']}",
            "# TYPE dist_glm5_steps_total counter",
            f"dist_glm5_steps_total {st.steps}",
            "# TYPE dist_glm5_stage_busy_seconds_total counter",
        ]
        busy: dict[int, float] = {}
        for k, v in st.stage_busy.items():
            busy[k.stage] = busy.get(k.stage, 0.0) + v
        for t in getattr(self.loop.c.pipeline, "timings", []):
            busy[t.stage] = busy.get(t.stage, 0.0) + t.busy_s
        for stage, v in sorted(busy.items()):
            lines.append(f'dist_glm5_stage_busy_seconds_total{{stage="{stage}"}} {v:.6f}')
        lines += [
            "# TYPE dist_glm5_mtp_drafts_total counter",
            f"dist_glm5_mtp_drafts_total {st.drafts_proposed}",
            "# TYPE dist_glm5_mtp_accepted_total counter",
            f"dist_glm5_mtp_accepted_total {st.drafts_accepted}",
        ]
        return "\n".join(lines) + "\n"


def make_handler(app: App):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # route the stdlib's access log to logging
            log.debug("%s " + fmt, self.address_string(), *args)

        def _json(self, status: int, obj) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _error(self, e: RequestError) -> None:
            self._json(
                e.status,
                {
                    "error": {
                        "message": str(e),
                        "type": "invalid_request_error" if e.status < 500 else "server_error",
                        "code": e.code,
                        "param": None,
                    }
                },
            )

        def _auth(self) -> bool:
            if app.api_key and self.headers.get("Authorization") != f"Bearer {app.api_key}":
                self._error(RequestError(401, "invalid or missing API key", "invalid_api_key"))
                return False
            return True

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {"status": "ok"})
            if not self._auth():
                return
            if self.path == "/metrics":
                raw = app.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                return self.wfile.write(raw)
            if self.path == "/v1/models":
                return self._json(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": app.model_name,
                                "object": "model",
                                "created": int(app.started),
                                "owned_by": "dist-glm5",
                                "max_model_len": app.max_model_len,
                            }
                        ],
                    },
                )
            self._error(RequestError(404, f"no route {self.path}", "not_found"))

        def do_POST(self):
            if not self._auth():
                return
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            try:
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    raise RequestError(404, f"no route {self.path}", "not_found")
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError as e:
                    raise RequestError(400, f"invalid JSON body: {e}") from None
                if not isinstance(body, dict):
                    raise RequestError(400, "the body must be a JSON object")
                chat = self.path.endswith("chat/completions")
                params, body = app.params(body, CHAT_KEYS if chat else COMPLETION_KEYS, chat)
                ids = app.prompt_ids(body, chat)
                app.check_len(ids, params)
                self._serve(ids, params, body, chat)
            except RequestError as e:
                self._error(e)

        def _serve(self, ids, params, body, chat):
            h = app.loop.submit(ids, params)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            stream = bool(body.get("stream"))
            hold = (
                max((len(s) for s in params.stop), default=1) - 1
            )  # text that may still become a stop string
            tokens: list[int] = []
            sent_text = ""
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(text=None, finish=None, role=False):
                if chat:
                    delta = (
                        {"role": "assistant"}
                        if role
                        else ({} if text is None else {"content": text})
                    )
                    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {
                        "index": 0,
                        "text": text or "",
                        "finish_reason": finish,
                        "logprobs": None,
                    }
                return {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": app.model_name,
                    "choices": [choice],
                }

            first = True
            while True:
                kind, val = h.events.get()
                if kind in ("error", "invalid"):
                    if stream and not first:
                        self._sse({"error": {"message": str(val), "type": "server_error"}})
                        self._sse_end()
                        return
                    raise RequestError(400 if kind == "invalid" else 500, str(val), "engine_error")
                if kind == "delta":
                    tokens += val
                elif kind == "done":
                    seq = val
                    tokens = list(seq.output)
                text = app.tok.decode(tokens) if app.tok else ""
                if stream:
                    if first:
                        self._sse_start()
                        if chat:
                            self._sse(chunk(role=True))
                        first = False
                    # hold back a possible stop string, and a trailing partial character (a
                    # byte-level tokenizer decodes an unfinished UTF-8 sequence as U+FFFD until its
                    # last byte arrives)
                    stable = len(text.rstrip("\ufffd"))
                    upto = (
                        len(text)
                        if kind == "done"
                        else max(len(sent_text), min(stable, len(text) - hold))
                    )
                    if text[len(sent_text) : upto] and text.startswith(sent_text):
                        self._sse(chunk(text[len(sent_text) : upto]))
                        sent_text = text[:upto]
                if kind == "done":
                    break
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": len(seq.output),
                "total_tokens": len(ids) + len(seq.output),
            }
            finish = seq.finish_reason
            if stream:
                end = chunk(finish=finish)
                if (body.get("stream_options") or {}).get("include_usage"):
                    end["usage"] = usage
                self._sse(end)
                self._sse_end()
                return
            lp = None
            if params.logprobs is not None:
                toks = [app.tok.decode([t]) if app.tok else str(t) for t in seq.output]
                if chat:
                    lp = {
                        "content": [
                            {
                                "token": toks[i],
                                "logprob": x["logprob"],
                                "top_logprobs": [
                                    {
                                        "token": app.tok.decode([t]) if app.tok else str(t),
                                        "logprob": v,
                                    }
                                    for t, v in x["top"]
                                ],
                            }
                            for i, x in enumerate(seq.logprobs)
                        ]
                    }
                else:
                    lp = {
                        "tokens": toks,
                        "token_logprobs": [x["logprob"] for x in seq.logprobs],
                        "top_logprobs": [
                            {(app.tok.decode([t]) if app.tok else str(t)): v for t, v in x["top"]}
                            for x in seq.logprobs
                        ],
                    }
            choice = {"index": 0, "finish_reason": finish, "logprobs": lp}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
                choice["token_ids"] = seq.output
                if params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = [None] + seq.prompt_logprobs
            self._json(
                200,
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": app.model_name,
                    "choices": [choice],
                    "usage": usage,
                },
            )

        def _sse_start(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

        def _write_chunk(self, data: bytes):
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _sse(self, obj):
            self._write_chunk(f"data: {json.dumps(obj)}\n\n".encode())

        def _sse_end(self):
            self._write_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def serve_http(app: App, host: str, port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer((host, port), make_handler(app))
    httpd.daemon_threads = True
    return httpd
