"""Typed control messages between the coordinator and stage workers, encoded with msgpack.

Never pickle over a socket: every message is a dataclass registered here, sent as
[type name, field dict] and rebuilt field by field (nested dataclasses and lists of them included).
Tensors never travel here: hidden states go through torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

import msgpack

from dist_glm5.sampling.params import SamplingParams

_REGISTRY: dict[str, type] = {}


def message(cls):
    cls = dataclass(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


_REGISTRY["SamplingParams"] = SamplingParams


@message
class SeqWork:
    """One sequence's share of a step: tokens at positions start.. to run through every stage."""

    seq_id: int
    start: int
    tokens: list[int]
    sample: bool = True  # the last row is a sampling position (decode, or the last prefill chunk)
    draft: int | None = None  # tokens[-1] is an MTP draft to verify (speculative decoding)
    params: SamplingParams | None = None  # sent with a sequence's first chunk; workers keep it
    prompt_logprobs_from: int | None = None  # prompt positions >= this get prompt logprobs
    lookahead: int | None = (
        None  # the prompt token after this (non-final prefill) chunk: MTP row input
    )
    # cache blocks appended to this sequence's block table before this work runs (the scheduler's
    # ledger chose them; every stage writes its own cache at the same block ids)
    blocks: list[int] = field(default_factory=list)


@message
class StepPlan:
    step: int
    work: list[SeqWork]
    release: list[int] = field(default_factory=list)  # finished: drop cache and state, first
    preempted: list[int] = field(default_factory=list)  # drop the cache only (recomputed later)


@message
class SeqOutput:
    seq_id: int
    tokens: list[int]  # emitted this step: the sampled token, or accepted draft + bonus
    draft: int | None = None  # next MTP draft, if speculative decoding is on
    accepted: int | None = None  # drafts accepted this step (None: no draft was verified)
    logprobs: list[dict] = field(
        default_factory=list
    )  # per emitted token: {"token", "logprob", "top": [[id, lp]..]}
    prompt_logprobs: list[dict] = field(default_factory=list)
    error: str | None = None  # this sequence alone failed (e.g. its sampling); the others did not


@message
class StageTime:
    """Seconds one worker was busy on a step (waiting for the previous stage excluded)."""

    stage: int
    rank: int
    seconds: float


@message
class StepResult:
    step: int
    outputs: list[SeqOutput]
    stage_times: list[StageTime] = field(default_factory=list)
    peak_rss_mb: float = 0.0  # the reporting worker's peak resident memory so far
    events: list = field(
        default_factory=list
    )  # profiler spans [name, start s, duration s, depth] when profiling


@message
class StepTiming:
    """A non-sampling stage's time on one step (the last stage's rides in StepResult)."""

    step: int
    stage: int
    busy_s: float
    send_s: float
    sent_bytes: int
    peak_rss_mb: float = 0.0
    rank: int = 0
    events: list = field(default_factory=list)


@message
class Hello:
    """A worker is loaded and listening."""

    stage: int
    rank: int
    pid: int


@message
class Heartbeat:
    """A worker is alive: sent every `heartbeat_interval` s by a thread of its own, whatever its
    main thread is doing (torch ops and gloo waits release the GIL); a stopped or hung process
    sends none. `done` is the last step it finished, `working` the one it is on (None: idle)."""

    stage: int
    rank: int
    pid: int
    done: int = -1
    working: int | None = None


@message
class WorkerError:
    stage: int
    rank: int
    step: int | None
    error: str


@message
class Shutdown:
    reason: str = ""


def pack(msg) -> bytes:
    return msgpack.packb([type(msg).__name__, _to_plain(msg)], use_bin_type=True)


def unpack(raw: bytes):
    name, data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if name not in _REGISTRY:
        raise ValueError(f"unknown message type {name!r}")
    return _build(_REGISTRY[name], data)


def _to_plain(x):
    if dataclasses.is_dataclass(x):
        return {f.name: _to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    return x


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _build(tp, data):
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(args[0], data) if len(args) == 1 else data
    if origin in (list, tuple):
        (arg, *_) = typing.get_args(tp) or (typing.Any,)
        vals = [_build(arg, v) for v in data]
        return tuple(vals) if origin is tuple else vals
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        return tp(**{k: _build(hints.get(k, typing.Any), v) for k, v in data.items()})
    return data
