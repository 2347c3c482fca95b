"""The server's limits: what one client or one request may cost, each with its flag.

Every limit exists so that no single client or request can stall the others: connections and
their timeouts bound what idle or slow sockets hold; the body size and list lengths bound what
one request costs to parse, check, schedule and match every step. A request over a limit is a
400 (413 for the body) whose message names the field, the limit and the flag that changes it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from .errors import ApiError


@dataclass(frozen=True)
class Limits:
    # connections (launch/api/connections.py)
    max_connections: int = 4096  # open at once; past it the oldest idle one is closed
    header_timeout: float = 10.0  # seconds for a request's head (a new or kept-alive socket)
    keep_alive_timeout: float = 15.0  # seconds an idle keep-alive connection stays open
    # a request body (launch/api/body.py)
    max_body_bytes: int = 8 << 20  # a 637K-token prompt as JSON token ids is ~5 MB
    body_timeout: float = 30.0  # seconds to receive the whole body once the head is in
    # one request's fields (launch/api/engine_request.py)
    max_prompt_chars: int = 4 << 20  # text to tokenize, per prompt or chat (~1M tokens or more)
    max_choices: int = 16  # prompts x n (each choice is its own sequence)
    max_stop: int = 64  # stop strings (matched on every step's text)
    max_stop_token_ids: int = 1024
    max_bad_words: int = 1024  # (each banned word is checked on every step)
    max_logit_bias: int = 1024
    max_guided_choice: int = 1024
    max_tools: int = 128  # as OpenAI
    max_messages: int = 4096

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def check(self, field: str, count: int, limit_name: str) -> None:
        """A 400 naming the field, the limit and its flag when `count` is over the limit."""
        limit = getattr(self, limit_name)
        if count > limit:
            raise ApiError(
                400,
                f"{field} has {count} entries; this server allows at most {limit} "
                f"(--{limit_name.replace('_', '-')})",
                field,
                "limit_exceeded",
            )


DEFAULT_LIMITS = Limits()

HELP = {
    "max_connections": "open connections at once; past it the oldest idle one is closed",
    "header_timeout": "seconds a connection has to send a request's head",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "max_body_bytes": "largest request body (413 past it)",
    "body_timeout": "seconds to receive a request's body",
    "max_prompt_chars": "longest prompt text (per prompt, or a rendered chat)",
    "max_choices": "prompts x n in one request",
    "max_stop": "stop strings per request",
    "max_stop_token_ids": "stop_token_ids per request",
    "max_bad_words": "bad_words per request",
    "max_logit_bias": "logit_bias entries per request",
    "max_guided_choice": "guided_choice entries per request",
    "max_tools": "tools per request",
    "max_messages": "messages per chat request",
}


def add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server limits (README: Limits and timeouts)")
    for f in fields(Limits):
        g.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            help=f"{HELP[f.name]} (default {f.default})",
        )
