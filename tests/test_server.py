"""`launch single-node` and `launch two-node` as a user runs them, through the official openai
client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import require

openai = require("openai")
LAUNCH = [
    sys.executable,
    "-c",
    "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
]


def start(*args, env=None):
    p = subprocess.Popen(
        [*LAUNCH, *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    t0 = time.monotonic()
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(p.stderr.read()[-3000:])
    ready = json.loads(line)
    ready["startup_s"] = time.monotonic() - t0
    return p, ready


def stop(p):
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()


@pytest.fixture(scope="module")
def single(default_model_dir):
    # the model the oracle fixtures load (the random one), not the shipped trained default
    p, ready = start(
        "single-node", "--model", str(default_model_dir), "--ctx", "4k", "--api-key", "sekret"
    )
    yield openai.OpenAI(base_url=ready["url"], api_key="sekret", max_retries=0), ready
    stop(p)


def _chat_prompt_ids(model_dir, messages):
    """The prompt ids the server builds for a chat (launch/api/chat_template.py): the
    checkpoint's chat_template rendered by jinja2, or, for a tokenizer without one (the embedded
    model), role tags and an open assistant turn; then the checkpoint's tokenizer."""
    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    tc = model_dir / "tokenizer_config.json"
    template = json.loads(tc.read_text()).get("chat_template") if tc.exists() else None
    if template:
        from jinja2 import Template

        text = Template(template).render(messages=messages, add_generation_prompt=True)
    else:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    return tok, tok.encode(text)


def test_chat_content_is_the_reference_greedy_generation(single, default_model_dir, default_model):
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    client, ready = single
    messages = [{"role": "user", "content": "Hello"}]
    tok, ids = _chat_prompt_ids(default_model_dir, messages)
    want = generate(default_model, [ids], SamplingParams(max_tokens=6))[0].token_ids
    assert len(want) == 6  # no early eos: six tokens to compare
    r = client.chat.completions.create(
        model=ready["model"], messages=messages, max_tokens=6, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids), "the server rendered a different chat prompt"
    assert r.usage.completion_tokens == len(want)
    assert r.choices[0].message.content == tok.decode(want)
    # the same prompt ids as a completion return the token ids themselves
    c = client.completions.create(model=ready["model"], prompt=ids, max_tokens=6, temperature=0)
    assert c.choices[0].model_extra["token_ids"] == want
    assert c.choices[0].text == r.choices[0].message.content


def test_chat_and_streamed_completion(single):
    client, ready = single
    model = client.models.list().data[0].id
    assert model == ready["model"]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    assert text == whole.choices[0].text and whole.usage.completion_tokens == 8
    # usage in its own final chunk with no choices, as OpenAI sends it
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"


def test_bad_requests_get_4xx_and_serving_goes_on(single):
    client, ready = single
    model = ready["model"]
    for kw, status in [
        (dict(model="nope", prompt="x"), 404),
        (dict(model=model, prompt="x", max_tokens=-1), 400),
        (dict(model=model, prompt="x", suffix="y"), 400),  # an OpenAI field not supported
        (dict(model=model, prompt="x" * 5000, max_tokens=4), 400),
        (dict(model=model, prompt=[1, 2, 99999]), 400),
    ]:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**kw)
        assert e.value.status_code == status and e.value.message, kw
    import urllib.request

    req = urllib.request.Request(
        ready["url"] + "/completions",
        data=b"{not json",
        method="POST",
        headers={"Authorization": "Bearer sekret"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and b"invalid JSON" in e.value.read()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=ready["url"], api_key="wrong", max_retries=0).models.list()
    assert (
        # ignore_eos: a sampled <eos> would end the reply after one token (seen once in CI order)
        client.completions.create(
            model=model, prompt="ok", max_tokens=2, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 2
    )
    metrics = (
        urllib.request.urlopen(
            urllib.request.Request(
                ready["url"].replace("/v1", "/metrics"), headers={"Authorization": "Bearer sekret"}
            )
        )
        .read()
        .decode()
    )
    assert (
        "dist_glm5_request_success_total" in metrics
        and "dist_glm5_time_to_first_token_seconds_count" in metrics
    )


def test_two_node_on_a_local_ray_cluster_gives_the_same_greedy_text(single, default_model_dir):
    from dist_glm5.stages.ray_pipeline import local_cluster

    client, ready = single
    # 150+ tokens: above the embedded model's index_topk (64), so DSA selection happens
    prompt = "Two nodes, one pipeline: the first stage embeds, the last one samples. " * 3
    assert len(prompt.encode()) > 150
    want = client.completions.create(
        model=ready["model"], prompt=prompt, max_tokens=10, temperature=0
    )
    cluster = local_cluster(2, cpus_per_node=2)
    try:
        p, r2 = start(
            "two-node",
            *("--model", str(default_model_dir), "--ctx", "8k"),
            *("--address", cluster.address, "--mtp"),
        )
        try:
            c2 = openai.OpenAI(base_url=r2["url"], api_key="none", max_retries=0)
            got = c2.completions.create(
                model=r2["model"], prompt=prompt, max_tokens=10, temperature=0
            )
            assert got.choices[0].text == want.choices[0].text
        finally:
            stop(p)
    finally:
        cluster.shutdown()
