"""Structured output through two pipeline stages (Ray actors on a local two-node cluster, the
grammar travelling in SamplingParams over msgpack to the last stage): 50 JSON schemas, each
generated greedy and sampled, with MTP off and on (one engine run of 100 requests per setting),
every output validated by `jsonschema`; the greedy outputs with MTP are those without (a draft is
verified under the grammar's mask).

The schemas are test_grammar.py's, with numbers given a multipleOf (the random model, greedy, would
otherwise write digits for ever: a number's fraction is unbounded in JSON)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from runtime_util import prompts, ray_nodes
from test_grammar import SCHEMAS as GRAMMAR_SCHEMAS

from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout
from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.config import ModelConfig
from dist_glm5.sampling.grammar import GrammarSpec
from dist_glm5.sampling.params import SamplingParams


def bounded(s):
    if isinstance(s, dict):
        s = {k: bounded(v) for k, v in s.items()}
        if s.get("type") == "number":
            s["multipleOf"] = 0.25
    elif isinstance(s, list):
        s = [bounded(v) for v in s]
    return s


SCHEMAS = [bounded(s) for s in GRAMMAR_SCHEMAS]
PROMPTS = prompts([3 + i % 7 for i in range(len(SCHEMAS))], seed=11)


@pytest.fixture(scope="module")
def cluster():
    with ray_nodes(2, cpus_per_node=4) as c:
        yield c


ROWS = [(i, greedy) for i in range(len(SCHEMAS)) for greedy in (True, False)]


@pytest.fixture(scope="module")
def runs(cluster, default_model_dir):
    """mtp -> ([(schema, greedy, seq)], drafts accepted): each engine's requests in one run."""
    from dist_glm5.stages.ray_pipeline import RayPipeline

    cfg = ModelConfig.from_hf(default_model_dir)
    out = {}
    for mtp in (False, True):
        engine = EngineConfig(
            str(default_model_dir),
            Layout(2, 1, 1),
            CacheConfig(160),
            SchedulerConfig(chunk_tokens=64, max_seqs=128),
            mtp=mtp,
            threads=1,  # torch's default threads per actor oversubscribe 2 cores (20x slower)
        )
        c = Coordinator(
            RayPipeline(engine),
            engine.scheduler,
            cfg.eos_token_id,
            cfg.vocab_size,
            step_timeout=120,
        )
        try:
            assert len(set(c.pipeline.node_of_stage.values())) == 2  # one stage per node
            params = [
                SamplingParams(
                    max_tokens=400,
                    grammar=GrammarSpec.json_schema(SCHEMAS[i]),
                    temperature=0.0 if greedy else 1.0,
                    seed=i,
                )
                for i, greedy in ROWS
            ]
            seqs = c.run([PROMPTS[i] for i, _ in ROWS], params)
            out[mtp] = ([(i, g, s) for (i, g), s in zip(ROWS, seqs)], c.stats.drafts_accepted)
        finally:
            c.close()
    return out


@pytest.mark.parametrize("mtp", [False, True], ids=["mtp-off", "mtp-on"])
def test_json_schema_outputs_validate_through_two_stages(runs, mtp):
    from dist_glm5.checkpoint.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    rows, accepted = runs[mtp]
    for i, _, s in rows:
        assert s.finish_reason == "stop" and s.output[-1] == 257, (s.finish_reason, SCHEMAS[i])
        jsonschema.validate(json.loads(tok.decode(s.output)), SCHEMAS[i])
    if mtp:
        assert accepted > 0  # forced characters are proposed and accepted
        # greedy speculative decoding under a grammar emits exactly what plain decoding does
        greedy = [[s.output for _, g, s in runs[m][0] if g] for m in (False, True)]
        assert greedy[0] == greedy[1]
