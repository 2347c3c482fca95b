"""The trainer of the embedded default model, on this kind of machine (`dist-glm5 bench
train-default` runs it: bench/train_default.py).

A small GLM-5-architecture model (byte-level, 4 layers, MLA + DSA indexer + MoE + one MTP layer)
trained with transformers' GlmMoeDsaForCausalLM plus an MTP block built from its pieces:
- LM loss (next byte) + MTP_WEIGHT * MTP loss (the byte after next, DeepSeek-V3: the MTP block
  reads the main model's post-norm hidden state h_i and the embedding of t_{i+1}; the embedding of
  the row at position 0 is zeroed, as our runtime and vLLM do), plus the main model's own
  distribution for that byte (mtp_distill: a draft is accepted when it is the model's choice).
- The DSA indexer as DeepSeek-V3.2 trains it: its input is detached (it learns only from its own
  KL loss, the model only from the LM loss); target p_t = the main attention's weights summed over
  heads (of its layer and the "shared" layers that reuse its selection) and L1-normalised; loss
  KL(p_t || softmax(I_t)). Dense warm-up first (all keys attended; transformers' indexer is
  replaced by one that keeps its graph), then sparse training: top-index_topk selection on and the
  KL restricted to the selected set.
- MoE balance without an auxiliary loss (DeepSeek-V3): after each step every router's correction
  bias moves by BIAS_RATE toward the experts that got fewer tokens than the mean.
- Attention supervision (without it the seed run never learned to copy in ~2M tokens: induction
  sits behind a long plateau a 2-core hour cannot cross). Heads 0-2 of layer 0 are told to read
  the byte 1, 2, 3 back (with training-only linear read-outs naming that byte); head 0 of layer 2
  (a full-indexer layer, so its selection can find the byte) is told to read the byte after the
  earlier occurrence of the current context on rows of repeats, whose source the synthetic
  documents know; its output must name that byte through its own o_proj columns and lm_head; the
  LM loss on those rows counts twice; the indexer of that layer is told to rank that key first
  (its KL alone never selected it). All of it is a loss: the exported model is the plain
  architecture.
- Chat rows (chat_corpus.py): the assistant's ids (calls, JSON replies, answers, <eos>) count
  1 + REPLY_WEIGHT times in the LM loss.
- Columns: one more head of layer 0 attends evenly over the last 16 bytes, and training-only
  read-outs name the run of spaces ending at each byte (from layer 0's output) and the indentation
  of the line a newline or leading space opens (from layer 2's output): without them greedy code
  wrote spaces forever (the model gave the next space the same probability after 4 or 12).
- Structure (structure.py): training-only read-outs name, from layer 2's output, the innermost
  open GLM tag and the JSON context (depth, bracket, inside a string) of every byte: calls closed
  a value with the wrong tag and JSON ran on without them.
- Sparse joint steps force the keys the heads are told to read into the full indexers'
  selection: every row's neighbours OFFSETS back, and on repeats the induction key (an indexer
  misses them while it learns, and a model trained on those misses learns not to copy); a last
  phase trains only the indexers on the final, frozen model (jointly trained, they trail the
  features that move under them).
- The draft: the MTP layer learns jointly at MTP_WEIGHT, then alone in a "draft" phase on the
  frozen model (its CE and its KL to the model's next distribution), sparse as it serves.
- Unloop (opt-in, --unloop N; unloop.py): a phase of the sequence-level unlikelihood loss on the
  model's own greedy loops (the bytes of its continuations of code and chat prompts that repeat
  the bytes a period back), beside the usual losses, before the indexers' and the draft's phases.
- The dense phases run every 8th step as one row of 2,048 bytes (the same tokens): RoPE scores at
  distances never trained are unconstrained, and a run trained only at 512 lost layer 0's
  neighbours on every row past 512 once it saw 1,024 (measured on its step-1800 weights, dense or
  sparse alike: -log attention on the previous byte 0.0 before row 512, 7.8 after).
Data: corpus.py (stdlib windows, needle, copy and repeat documents with their source maps).
Deterministic per step (the batch of step s depends only on the seed and s), so a resumed run sees
the data it would have seen.
Checkpoints every --save-every steps to <out>/state.pt; rerunning the command resumes.
One torch thread by default: on this machine's 2 cores, shared with other jobs, two threads made a
step about 7x slower (oversubscribed OpenMP), one thread ~1.5 s for 2,048 tokens of phase one.

Run the recipe (about 2 h 45 min on one thread here); the shipped weights are this command:
    dist-glm5 bench train-default --out RUN --seed 1 --skip-p 0.5 \\
        --export dist_glm5/checkpoint/default_model/trained
(run p1 in docs/trained_default.md: held-out 1.570 nats/byte; tools 21/21, json_object 9/10,
json_schema 10/10, needles 5/6 at 4K and at 16K; greedy code still spaces; MTP greedy acceptance
0.606 +- 0.014 over 32 held-out prompts x 64 tokens, --mtp 0.93x).
Earlier runs without the skips: seeds 0-2 held-out 1.55-1.70, no needle found past 2K.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import random
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dist_glm5.checkpoint.bpe import BpeTokenizer
from dist_glm5.checkpoint.tokenizer import FIRST_RUN_ID, ByteTokenizer

from . import simple_code, unloop
from .structure import N_JSON, N_TAG, structure_targets

log = logging.getLogger(__name__)
TRAIN_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_topk": 64,
    "index_head_dim": 32,
    "index_n_heads": 16,
    "indexer_types": ["full", "shared", "full", "shared"],
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "bos_token_id": 256,
    "eos_token_id": [257],
    "pad_token_id": 258,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "initializer_range": 0.06,  # ~1/sqrt(hidden): 0.02 left attention in a long plateau
    "dtype": "bfloat16",
}
MTP_WEIGHT = 0.3
# The MTP block's draft is kept when it equals the main model's own next choice, not the data's:
# besides the data's byte it learns the main model's distribution for that byte (KL to the
# detached logits of the next row; EAGLE and Medusa-2 draft heads are trained on their verifier
# the same way). Acceptance was 0.61-0.66 on held-out text with the data's byte alone.
MTP_DISTILL = 1.0
SUPERVISION = (
    "offset",
    "readout",
    "ind",
    "copy",
    "lm_copy",
    "index",  # reaches only the indexers (their inputs are detached)
    "window",
    "run",
    "indent",
    "tag",
    "json",
    "match",
)  # attention_supervision's and structure_losses' losses, weight 1
LINE_LOSSES = ("line_indent", "line_end")  # attention_supervision's with line heads, weight 1
# Attention supervision (see Trainer.attention_supervision): heads h of OFFSET_LAYER read the byte
# OFFSETS[h] back; head 0 of INDUCTION_LAYER reads the byte after the earlier occurrence of the
# current context. INDUCTION_LAYER has a full indexer (its selection must find that byte).
OFFSET_LAYER, OFFSETS, INDUCTION_LAYER = 0, (1, 2, 3), 2
# With 3 offset heads the induction head matches 3 ids (its key sees the 3 before it, its query
# the current id and 2 before): needles whose keys end in the same digit (`[key 2291: ` and
# `[key 6141: ` both end `1: `) look alike: teacher-forced, p1e's head 0 puts 0.71 and 0.72 of
# its weight on 6141's value for either key. A 4th offset head (4 back: OFFSETS_FAR) makes it 4 ids.
# It takes the column head, so it goes with space runs only (no column losses there).
OFFSETS_FAR = (1, 2, 3, 4)
# x1 (OFFSETS_FAR) told the needles apart and stopped reading them (its copy loss stayed near 3.5
# nats, 2.5 with three heads; a latent twice as wide did not help). The match head instead (off
# unless asked: --match-head): head MATCH_HEAD of MATCH_LAYER reads the id before, whose residual
# holds OFFSET_LAYER's three reads, so a key also carries the id 4 back and layer 0 keeps its
# free head.
MATCH_LAYER, MATCH_HEAD = 1, 0
# Position-free copying: head 0 of INDUCTION_LAYER and the first half of its indexer's heads
# have no rotary query (their q_b_proj / wq_b rows for the rope dims are held at zero),
# so they match on content alone and score a key 16K back as they score one 100 back. Copying is
# then not bound to the distances trained (at most 4,096 here; needles are asked at 16K and 64K).
# The other heads keep their positions (the neighbours OFFSETS back are positional).
# Columns (greedy code wrote spaces forever: after 4, 8, 9 or 12 spaces of indentation the seed-1
# weights gave the next space the same 0.55, so the model did not know how far into a line it
# was). Head COLUMN_HEAD of OFFSET_LAYER attends evenly over the last COLUMN_WINDOW bytes (their
# mix counts the spaces among them); training-only read-outs name, from OFFSET_LAYER's output,
# the run of spaces ending at each byte, and from INDENT_LAYER's output, on a line's newline and
# leading spaces, how far that line is indented (both clipped at COLUMN_WINDOW).
COLUMN_HEAD, COLUMN_WINDOW, INDENT_LAYER = len(OFFSETS), 16, 2
# Lines (off unless asked: --line-heads). With the column read-outs alone greedy code still wrote
# spaces: p1 (PoSE, seed 1) at step 3,010 gave the next space 0.43 after the 8 spaces a for
# loop's body takes and 0.98 one space later, and its indent read-out stayed near 0.8 nats. A
# line's indentation is the previous non-blank line's, one level deeper after a colon, so heads
# LINE_HEADS of INDENT_LAYER are told to read, on a line's newline and leading spaces, the last
# indentation byte of that previous line (its run of spaces, from OFFSET_LAYER, is the
# indentation) and the last byte before the newline (the colon); INDENT_LAYER has a full
# indexer, told to select those keys as it is the induction key.
LINE_HEADS = (1, 2)
# the keys every full indexer's selection keeps in sparse joint steps (forced_keys): how far back
FORCED_BACK = sorted(set(OFFSETS) | set(range(1, COLUMN_WINDOW)))
assert INDENT_LAYER == INDUCTION_LAYER  # the line heads' keys are ranked by its indexer
INDUCTION_LR = 4.0  # x the base rate for the induction layer's attention (its slow bilinear start)
BIAS_RATE = 1e-3
# The assistant's ids of chat rows (calls, JSON replies, answers, <eos>) count 1 + REPLY_WEIGHT
# times in the LM loss: at step 2,025 of the first plain-English run the model gave the first
# byte of a call's value, and the "<" that closes it, about 1% (it had read ~2,000 calls: in a
# tool chat the tools' listing is most of the bytes).
REPLY_WEIGHT = 2.0


@dataclass(frozen=True)
class Phase:
    end: int  # last step (exclusive)
    seq: int
    batch: int
    sparse: bool  # top-index_topk selection on
    mix: str  # MIXES key
    # "all": the model and its indexers; "indexers": the model frozen; "draft": the MTP layer
    # alone (less its indexer) on its own losses, the model frozen
    train: str = "all"
    # every long_every-th step runs one row of LONG_SEQ instead (0: never): the dense phases
    # see the distances the sparse phases ask for (see the module docstring)
    long_every: int = 0
    # the weight of the unlikelihood loss on the model's own greedy loops (unloop.py), beside
    # the usual losses, at the constant UNLOOP_LR (0: off)
    unlikelihood: float = 0.0

    def shape(self, step: int) -> tuple[int, int]:
        """(seq, batch) of this step."""
        if self.long_every and step % self.long_every == self.long_every - 1:
            return LONG_SEQ, 1
        return self.seq, self.batch


LONG_SEQ = 2048
PHASES = [
    Phase(900, 512, 4, False, "drill", long_every=8),  # copying first: supervised heads form
    Phase(2700, 512, 4, False, "base", long_every=8),  # the chats learned here, with the code
    # sparse selection on; the keys the supervised heads read are forced into their rows'
    # selection (forced_keys) so the model learns to copy at these lengths while the indexers
    # learn to find those keys
    Phase(2850, 1024, 2, True, "long"),
    Phase(2930, 2048, 1, True, "long"),
    Phase(2950, 4096, 1, True, "long"),  # a few steps beyond 2K: needles are asked at 3K+
    # the indexers alone on the final model (DeepSeek-V3.2's warm-up also trains only the
    # indexer): trained jointly, they trail features that move under them and lose the key
    Phase(3010, 2048, 2, True, "long", "indexers"),
    # the draft layer alone on the final model, sparse as it serves, with the selection its
    # (frozen) indexer makes: jointly it learns at MTP_WEIGHT under a moving target (p1: greedy
    # acceptance 0.71, break-even ~0.68). The indexers are not re-fitted after it: 40 more steps
    # of theirs moved the model's selection and cost 3 tool calls and a needle (p1d)
    Phase(3310, 512, 4, True, "base", "draft"),
]


def phases(base_extra: int = 0, unloop_steps: int = 0, unloop_at: str = "end") -> list[Phase]:
    """The recipe's phases with the base phase `base_extra` steps longer (the later phases move
    with it): with both cores (--threads 2, about 1.7x the steps an hour) the 3-hour budget
    holds more of the base mix, where the code and the chats are learned. unloop_steps: an "unloop"
    phase of that many steps (the unlikelihood loss on the model's own greedy loops, unloop.py)
    after the long sparse phases, before the indexers' and the draft's (they fit the final
    model). unloop_at "long": the unloop phase comes before the long sparse phases instead, so
    that they train long copying again after it (p4v, unloop after them, lost 16K needles; q1,
    before them, kept 4K needles and lost what the phase did to greedy code). "end-long": after
    them, as "end", with their rows (2,048 bytes of the long mix) beside the unlikelihood loss,
    so that long copying trains while the loops are taken out."""
    base_end = next(ph.end for ph in PHASES if ph.mix == "base")
    plan = [
        ph if ph.end < base_end else dataclasses.replace(ph, end=ph.end + base_extra)
        for ph in PHASES
    ]
    if not unloop_steps:
        return plan
    if unloop_at not in UNLOOP_AT:
        raise ValueError(f"unloop_at {unloop_at!r}: use one of {', '.join(UNLOOP_AT)}")
    # the phase the unloop phase goes before: the first long one ("long"), else the indexers'
    at = next(
        i
        for i, ph in enumerate(plan)
        if (ph.mix == "long" if unloop_at == "long" else ph.train == "indexers")
    )
    seq, batch, mix = (2048, 1, "long") if unloop_at == "end-long" else (512, 4, "base")
    ul = Phase(plan[at - 1].end + unloop_steps, seq, batch, True, mix, unlikelihood=UNLOOP_WEIGHT)
    later = [dataclasses.replace(ph, end=ph.end + unloop_steps) for ph in plan[at:]]
    return plan[:at] + [ul] + later


UNLOOP_AT = ("end", "long", "end-long")  # where the unloop phase goes (phases)
DRAFT_LR = 5e-4  # the draft layer's constant rate in the "draft" phase
UNLOOP_LR = 2e-4  # the model's constant rate in the "unloop" phase: the cosine's floor
UNLOOP_WEIGHT = 1.0  # Welleck et al.'s alpha
UNLOOP_ROWS = (2, 2)  # code prompts, chat prompts continued greedily each unloop step (~0.7 s each)
INDEXER_LR = 3e-3  # the indexers' constant rate in the "indexers" phase (and layer 2's always)

# Positional skips (PoSE: Zhu et al. 2023, "Efficient context window extension of LLMs via
# positional skip-wise training"), off unless asked (--skip-p): a row's position ids jump once,
# at a random byte, by a log-uniform skip of up to SKIP_MAX, so rows of 512-4,096 bytes train the
# RoPE distances a 16K-64K prompt asks. Without them the heads meet untrained distances past the
# longest row (s6-1, step 1,400: layer 0's previous-byte head put all its weight on keys over
# 2,048 back at byte 3,000). The text stays continuous; supervision that names a key by its
# distance skips the rows whose key lies across the jump (Trainer._near).
SKIP_MAX = 65536


def skip_positions(seed: int, step: int, batch: int, seq: int, p: float) -> torch.Tensor:
    """[batch, seq] position ids of a step: each row, with probability p, jumps once (a
    function of seed and step only, like the batch)."""
    rng = random.Random(f"skip:{seed}:{step}")
    pos = torch.arange(seq).repeat(batch, 1)
    for b in range(batch):
        if rng.random() < p:
            at = rng.randrange(1, seq)
            pos[b, at:] += int(math.exp(rng.uniform(0.0, math.log(SKIP_MAX - seq))))
    return pos


# data mixes: fractions of needle documents, copy documents (spans of code repeated), repeat
# documents (random strings repeated: only copying predicts them), chat documents (chats with
# tool calls, JSON replies and JSON documents: chat_corpus.py); the rest plain code. The long
# phases keep the base phase's chat share: at 10% they undid part of what it taught (seed 1:
# json_schema 9 -> 8 of 10, MTP acceptance 0.71 -> 0.52, held-out 1.507 -> 1.555)
MIXES = {
    "drill": {"needle": 0.3, "copy": 0.1, "repeat": 0.35, "chat": 0.1},
    "base": {"needle": 0.25, "copy": 0.1, "repeat": 0.05, "chat": 0.35},
    "long": {"needle": 0.3, "copy": 0.1, "repeat": 0.05, "chat": 0.3},
}
COPYING = ("needle", "copy", "repeat")  # the documents that teach copying


def code_mixes(code_share: float = 0.0) -> dict:
    """MIXES with the plain code of the base and long mixes at code_share: their copying
    documents (COPYING) scaled down to make room, the chats kept (0: MIXES, the committed recipe;
    the drill phase, where the supervised heads form, keeps its mix). A 3-hour run sees about a
    quarter of its text as code (session 10); the copying documents are 40-45% of these mixes."""
    if not code_share:
        return MIXES
    out = dict(MIXES)
    for name in ("base", "long"):
        f = MIXES[name]
        copying = sum(f[k] for k in COPYING)
        room = 1.0 - f["chat"]  # code + copying
        if not room - copying <= code_share < room:
            raise ValueError(
                f"code share {code_share} for the {name} mix: between its own "
                f"{room - copying:.2f} and {room:.2f} (the chats keep {f['chat']})"
            )
        scale = (room - code_share) / copying
        out[name] = {**f, **{k: f[k] * scale for k in COPYING}}
    return out


# ---- the model -------------------------------------------------------------------------------
def train_config(tok: ByteTokenizer, kv_lora_rank: int = TRAIN_CONFIG["kv_lora_rank"]) -> dict:
    """TRAIN_CONFIG, its vocabulary tok's and its MLA latent kv_lora_rank wide."""
    return dict(TRAIN_CONFIG, vocab_size=tok.vocab_size, kv_lora_rank=kv_lora_rank)


def hf_config(raw: dict | None = None):
    from transformers import GlmMoeDsaConfig

    raw = dict(raw or TRAIN_CONFIG)
    cfg = GlmMoeDsaConfig(**raw)
    cfg._attn_implementation = "eager"  # the attention weights are the indexer's target
    return cfg


class MTPBlock(torch.nn.Module):
    """The MTP layer (stored as model.layers.<num_hidden_layers>) from transformers' pieces."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaDecoderLayer,
            GlmMoeDsaRMSNorm,
        )

        n = cfg.num_hidden_layers
        c5 = copy.deepcopy(cfg)  # the block is layer n: an MoE block with its own indexer
        c5.num_hidden_layers = n + 1
        c5.indexer_types = list(cfg.indexer_types) + ["full"]
        c5.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
        H = cfg.hidden_size
        self.block = GlmMoeDsaDecoderLayer(c5, n)
        self.enorm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.shared_head_norm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb, h, position_embeddings, mask, position_ids):
        """emb: [B, S, H] embeddings of t_{i+1}; h: [B, S, H] post-norm hidden of row i."""
        emb = emb.masked_fill((position_ids == 0)[..., None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        x, _ = self.block(
            x,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
        )
        return self.shared_head_norm(x)

    def hf_names(self, n: int) -> dict[str, str]:
        """Our parameter names -> checkpoint names (model.layers.<n>.*)."""
        out = {}
        for k in self.state_dict():
            if k.startswith("block."):
                out[k] = f"model.layers.{n}." + k[len("block.") :]
            elif k.startswith("shared_head_norm."):
                out[k] = f"model.layers.{n}.shared_head.norm." + k.split(".", 1)[1]
            else:
                out[k] = f"model.layers.{n}.{k}"
        return out


def _hold_zero(p: torch.nn.Parameter, rows) -> None:
    """Rows of a weight zeroed and kept at zero: a gradient hook zeroes theirs (Adam's moments
    stay zero, so do its updates; weight decay of zero is zero)."""
    keep = torch.ones_like(p)
    keep[list(rows)] = 0
    with torch.no_grad():
        p.mul_(keep)
    p.register_hook(lambda g: g * keep)


KL_ROWS = 128


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cos/sin [B or 1, S, d] at query rows [B, R]."""
    t = t.expand(rows.shape[0], -1, -1)
    return t.gather(1, rows[..., None].expand(-1, -1, t.shape[-1]))


def forced_keys(
    induction: torch.Tensor, with_induction: bool, extra: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """[B, S, F] keys a row's selection keeps in sparse joint steps, -1: none: the neighbours
    FORCED_BACK back (OFFSETS and the column head's window; every full indexer's), the row's
    induction key (-1 off repeats) where with_induction, and any `extra` [B, S] keys (the line
    heads'). The model then learns from the keys its heads are told to read while the indexers
    learn to find them; at inference the indexer alone selects."""
    B, S = induction.shape
    t = torch.arange(S)
    keys = [(t - k).where(t >= k, -1).expand(B, S) for k in FORCED_BACK]
    if with_induction:
        keys.append(induction)
    keys.extend(extra)
    return torch.stack(keys, -1)


def _indexer_forward(
    self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None
):
    """transformers' indexer math with its graph kept on DETACHED inputs (it learns only from its
    KL loss); the scores are kept for the loss, the selection returned as transformers does."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        apply_rotary_pos_emb_interleave,
    )

    x, qr = hidden_states.detach(), q_resid.detach()
    B, S, _ = x.shape
    cos, sin = position_embeddings
    causal = attention_mask == 0 if attention_mask.dtype != torch.bool else attention_mask

    def scores_of(rows):  # rows: None (every query) or [B, R] query rows
        q = self.wq_b(
            qr if rows is None else qr.gather(1, rows[..., None].expand(-1, -1, qr.shape[-1]))
        )
        R = q.shape[1]
        q = q.view(B, R, self.n_heads, self.head_dim)
        r = self.qk_rope_head_dim
        c, s_ = (cos, sin) if rows is None else (_rows(cos, rows), _rows(sin, rows))
        q_rot, q_pass = torch.split(q, [r, self.head_dim - r], dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [r, self.head_dim - r], dim=-1)
        q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, q_rot, c, s_, unsqueeze_dim=2)
        _, k_rot = apply_rotary_pos_emb_interleave(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        # relu(x * s) == s * relu(x): the scale rides on the head weights
        sc = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
        xw = x if rows is None else x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))
        w = self.weights_proj(xw.to(self.weights_proj.weight.dtype)).float()
        w = w * (self.n_heads**-0.5 * self.softmax_scale)
        out = torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)  # [B, R, S]
        cm = causal if rows is None else causal.gather(1, rows[..., None].expand(-1, -1, S))
        return out.masked_fill(~cm, float("-inf"))

    topk = min(self.index_topk if self.sparse else S, S)
    if self.sparse:
        with torch.no_grad():
            sc = scores_of(None)  # [B, S, S]
            force = getattr(self, "force", None)  # [B, S, F] keys each row must keep, -1: none
            if force is not None:
                # a forced key outranks every pick: the lowest-ranked picks make room for the
                # forced keys the indexer missed
                lift = torch.where(force >= 0, float("inf"), float("-inf"))
                sc.scatter_reduce_(-1, force.clamp_min(0), lift, reduce="amax")
            sel = sc.topk(topk, dim=-1).indices
    else:  # dense warm-up: every key (the causal mask does the rest), no scores of every row
        sel = torch.arange(S).expand(B, S, S)
    # The KL loss reads KL_ROWS query rows per sequence (later rows weighted up: more keys)
    R = min(KL_ROWS, S)
    w_rows = torch.arange(1, S + 1, dtype=torch.float).expand(B, S)
    rows = torch.multinomial(w_rows, R, generator=self.rows_gen)
    rows = rows.sort(-1).values
    sel_rows = sel.gather(1, rows[..., None].expand(-1, -1, topk)) if self.sparse else None
    self.last = (rows, scores_of(rows), sel_rows)
    self.scores_of = scores_of  # attention_supervision scores the induction rows with it
    return sel.to(torch.int32)


class Trainer:
    def __init__(
        self,
        cfg,
        seed: int,
        line_heads: bool = False,
        tok: ByteTokenizer | None = None,
        offsets: tuple[int, ...] = OFFSETS,
        match_head: bool = False,
        copy_direct: float = 0.0,
    ):
        """tok: the vocabulary's tokenizer (default: bytes); offsets: how far back heads 0.. of
        OFFSET_LAYER read (OFFSETS, or OFFSETS_FAR with space runs); match_head: supervise
        MATCH_HEAD of MATCH_LAYER to read the id before; copy_direct: the share (0 to 1) of the
        copy loss taken on what the induction head adds to the logits (attention_supervision)."""
        from transformers import GlmMoeDsaForCausalLM

        torch.manual_seed(seed)
        self.cfg = cfg
        self.line_heads = line_heads  # LINE_HEADS supervised (see LINE_HEADS)
        self.lines: tuple[torch.Tensor, torch.Tensor] | None = None  # line_keys of the last call
        self.model = GlmMoeDsaForCausalLM(cfg).float()
        self.mtp = MTPBlock(cfg).float()
        self.mtp.apply(self.model._init_weights)
        self.attn_probs: dict[int, torch.Tensor] = {}
        self.indexers = []
        self.rows_gen = torch.Generator()  # reseeded every step (resumable)
        layers = list(self.model.model.layers) + [self.mtp.block]
        for i, layer in enumerate(layers):
            att = layer.self_attn
            att.register_forward_hook(self._keep_probs(i))
            if att.indexer is not None:
                att.indexer.forward = types.MethodType(_indexer_forward, att.indexer)
                att.indexer.sparse = False
                att.indexer.rows_gen = self.rows_gen
                self.indexers.append(i)
        self.heads: dict[int, torch.Tensor] = {}  # supervised layers' weights, graph kept
        self.values: dict[int, torch.Tensor] = {}  # their heads' outputs (o_proj's input)
        assert INDENT_LAYER in (OFFSET_LAYER, INDUCTION_LAYER)  # the line heads' weights are kept
        self.match_head = match_head
        if match_head:
            layers[MATCH_LAYER].self_attn.register_forward_hook(self._keep_head(MATCH_LAYER))
        if not 0.0 <= copy_direct <= 1.0:
            raise ValueError(f"copy_direct is a share of the copy loss, 0 to 1; got {copy_direct}")
        self.copy_direct = copy_direct  # train() sets it per phase (0 in the drill phase)
        self.resid: torch.Tensor | None = None  # the final norm's input (copy_direct)
        if copy_direct:
            self.model.model.norm.register_forward_pre_hook(self._keep_resid)
        for i in (OFFSET_LAYER, INDUCTION_LAYER):
            layers[i].self_attn.register_forward_hook(self._keep_head(i))
            layers[i].self_attn.o_proj.register_forward_hook(self._keep_value(i))
        self.key_copy = False  # train() sets it: attention_supervision adds key_copy_loss
        self.kv: torch.Tensor | None = None  # INDUCTION_LAYER's kv_b_proj output, every key's
        layers[INDUCTION_LAYER].self_attn.kv_b_proj.register_forward_hook(self._keep_kv)
        # training-only linear read-outs of the offset heads (not exported): each head's output
        # must name the byte it reads, so the induction head has keys to match (with run and tag
        # ids, those too)
        self.tok = tok or ByteTokenizer()
        if self.tok.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"vocab_size {cfg.vocab_size}, but the tokenizer has {self.tok.vocab_size} ids: "
                "pass the run's tokenizer (tok=ByteTokenizer(space_runs, chat_tags, space_unit))"
            )
        if len(offsets) > COLUMN_HEAD and not self.tok.space_ids:
            raise ValueError(
                f"offsets {offsets} take head {COLUMN_HEAD} of layer {OFFSET_LAYER}, the column "
                "head: only with space ids (--space-runs N or --space-unit N), which turn the "
                "column losses off"
            )
        self.offsets = tuple(offsets)
        self.n_read = cfg.vocab_size if self.tok.merges else 256
        self.readout = torch.nn.Linear(cfg.v_head_dim, self.n_read * len(self.offsets))
        n_col = COLUMN_WINDOW + 1
        self.columns = torch.nn.ModuleDict(
            {
                "run": torch.nn.Linear(cfg.hidden_size, n_col),
                "indent": torch.nn.Linear(cfg.hidden_size, n_col),
            }
        )
        self.structure = torch.nn.ModuleDict(
            {
                "tag": torch.nn.Linear(cfg.hidden_size, N_TAG),
                "json": torch.nn.Linear(cfg.hidden_size, N_JSON),
            }
        )
        self.outputs: dict[int, torch.Tensor] = {}  # residual after OFFSET_LAYER, INDENT_LAYER
        for i in (OFFSET_LAYER, INDENT_LAYER):
            layers[i].register_forward_hook(self._keep_output(i))
        self._content_only(layers[INDUCTION_LAYER].self_attn)
        self.loads: dict[int, torch.Tensor] = {}
        self.routers = {}
        for i, layer in enumerate(layers):
            if hasattr(layer.mlp, "gate"):
                self.routers[i] = layer.mlp.gate
                layer.mlp.gate.register_forward_hook(self._count(i))

    def _content_only(self, att) -> None:
        """Hold the rope rows of head 0's query and of the first half of the indexer heads'
        queries at zero (zeroed now, their gradients zeroed at every step)."""
        c = self.cfg
        head = c.qk_nope_head_dim + c.qk_rope_head_dim  # a head's q: [nope | rope]
        _hold_zero(att.q_b_proj.weight, range(c.qk_nope_head_dim, head))
        ix = att.indexer  # an indexer head's q: [rope | rest]
        rows = [
            h * ix.head_dim + j for h in range(ix.n_heads // 2) for j in range(c.qk_rope_head_dim)
        ]
        _hold_zero(ix.wq_b.weight, rows)

    def _keep_probs(self, i):
        def hook(mod, args, out):
            self.attn_probs[i] = out[1].detach().sum(1)  # [B, S, S], summed over heads

        return hook

    def _keep_head(self, i):
        def hook(mod, args, out):
            self.heads[i] = out[1]  # [B, heads, S, S]

        return hook

    def _keep_output(self, i):
        def hook(mod, args, out):
            self.outputs[i] = out[0] if isinstance(out, tuple) else out  # [B, S, H]

        return hook

    def _keep_resid(self, mod, args):
        self.resid = args[0]  # [B, S, H], the last layer's output before the final norm

    def _keep_kv(self, mod, args, out):
        self.kv = out  # [B, 1, S, heads * (qk_nope_head_dim + v_head_dim)]: every key's

    def _keep_value(self, i):
        def hook(mod, args, out):
            self.values[i] = args[0]  # [B, S, heads * v_head_dim]

        return hook

    def attention_supervision(
        self, ids: torch.Tensor, induction: torch.Tensor, direct_rows: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Losses that skip the induction plateau an hour of one core cannot cross (the seed run
        never learned to copy): -log attention of head h of OFFSET_LAYER on the byte OFFSETS[h]
        back, plus a read-out of that byte from the head's output; -log attention of head 0 of
        INDUCTION_LAYER on induction[b, t] (the key holding the byte to predict; rows of repeats
        only, -1 elsewhere). direct_rows [B] bool: the rows whose copy loss takes copy_direct's
        share (default: every row)."""
        w = self.heads[OFFSET_LAYER]
        B, S = ids.shape
        v = self.values[OFFSET_LAYER].view(B, S, -1, self.cfg.v_head_dim)
        offset = readout = 0.0
        for h, k in enumerate(self.offsets):
            keys = torch.arange(S - k).view(1, -1, 1).expand(B, -1, 1)
            near = self._near(k)  # [B, S - k]
            lw = torch.log(w[:, h, k:].gather(-1, keys).clamp_min(1e-6)).squeeze(-1)
            offset = offset - lw[near].mean()
            n = self.n_read
            lo = self.readout(v[:, k:, h])[..., n * h : n * (h + 1)]
            # <eos> (chat rows) is no byte to name, nor a key across a position jump: not counted
            byte = ids[:, :-k].masked_fill(~near, -100).reshape(-1)
            byte = byte.masked_fill((byte > 255) & (byte < FIRST_RUN_ID), -100)
            readout = readout + F.cross_entropy(lo.reshape(-1, n), byte)
        n_off = len(self.offsets)
        out = {"offset": offset / n_off, "readout": readout / n_off}
        if self.key_copy:  # the copy's value path at every key (key_copy_loss)
            out["key_copy"] = self.key_copy_loss(ids)
        if self.tok.space_ids:  # the column losses count bytes; a run id holds several
            out.update(dict.fromkeys(("window", "run", "indent"), w.sum() * 0.0))
        else:
            out.update(self._column_losses(ids, w[:, COLUMN_HEAD]))
        want = induction >= 0
        a = self.heads[INDUCTION_LAYER][:, 0].gather(-1, induction.clamp_min(0)[..., None])
        ind = -torch.log(a.squeeze(-1).clamp_min(1e-6))
        # what head 0 writes must name the byte it reads, in the unembedding's terms: its own
        # o_proj columns, the final norm and lm_head (the value path otherwise stays mute)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        if want.any():
            v0 = self.values[INDUCTION_LAYER][want][:, : self.cfg.v_head_dim]  # repeats' rows only
            r = self.resid[want] if self.copy_direct else None  # before norm() below replaces it
            lo = self._head0_logits(v0)
            copy = F.cross_entropy(lo, nxt[want], reduction="none")
            if self.copy_direct:
                # what head 0 adds to the model's logits (the final norm is linear in its input
                # at a fixed scale, so the logits are the sum of each part's): its output at the
                # whole residual's scale. The form above normalises the head's output alone, so
                # it trains the direction and not the size: teacher-forced on m1, a head with all
                # its weight on the needle's next id added +2.0 nats for it, and layer 3's MoE
                # -3.5 against it (docs/trained_default.md, "The copy's size"). Below a share of
                # 1 the rest stays on the normalised form: m2 (all of it direct) found every code
                # needle and repeated a JSON object's keys
                w_o = self._layer(INDUCTION_LAYER).self_attn.o_proj.weight[:, : v0.shape[-1]]
                norm = self.model.model.norm
                scale = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                lo = self.model.lm_head(norm.weight * F.linear(v0, w_o) * scale.detach())
                share = torch.full_like(copy, self.copy_direct)
                if direct_rows is not None:  # the other rows keep the normalised form alone
                    share = share * direct_rows[:, None].expand_as(want)[want]
                direct = F.cross_entropy(lo, nxt[want], reduction="none")
                copy = share * direct + (1 - share) * copy
            out["ind"] = ind[want].mean()
            out["copy"] = copy.mean()
            # the whole model on those rows, weighted up: head 0's byte is a small part of the
            # final residual, and the LM alone took hundreds of steps to start using it
            out["lm_copy"] = F.cross_entropy(self.logits[want], nxt[want])
        else:
            out["ind"] = out["copy"] = out["lm_copy"] = ind.sum() * 0.0
        if self.lines is not None:
            for name, h, key in zip(LINE_LOSSES, LINE_HEADS, self.lines):
                want = key >= 0
                a = self.heads[INDENT_LAYER][:, h].gather(-1, key.clamp_min(0)[..., None])
                # a far smaller floor than the others': these heads are trained ones, whose
                # weight on the key starts far below 1e-6, where that floor passes no gradient
                lw = torch.log(a.squeeze(-1).clamp_min(1e-30))
                out[name] = -lw[want].mean() if want.any() else lw.sum() * 0.0
        if self.match_head:  # -log weight on the id before (not across a position jump)
            near = self._near(1)
            keys = torch.arange(S - 1).view(1, -1, 1).expand(B, -1, 1)
            wm = self.heads[MATCH_LAYER][:, MATCH_HEAD, 1:].gather(-1, keys).squeeze(-1)
            out["match"] = -torch.log(wm.clamp_min(1e-6))[near].mean()
        else:
            out["match"] = w.sum() * 0.0
        out["index"] = self.index_loss(induction)
        return out

    def _near(self, k: int) -> torch.Tensor:
        """[B, S - k] bool: rows t >= k whose key k bytes back is also k positions back (false
        across a skip_positions jump) in the last `losses` call."""
        return self.pos[:, k:] - self.pos[:, :-k] == k

    def _column_losses(self, ids: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The column head's even window (w: its weights [B, S, S]) and the two read-outs."""
        B, S = ids.shape
        keys = torch.arange(S)[:, None] - torch.arange(COLUMN_WINDOW)  # [S, W]: the last W keys
        # the window's keys that are j positions back as well as j bytes (skip_positions)
        kp = self.pos.gather(1, keys.clamp_min(0).view(1, -1).expand(B, -1)).view(B, S, -1)
        inside = (keys >= 0) & (self.pos[..., None] - kp == torch.arange(COLUMN_WINDOW))
        # gathered, not masked: [B, S, W], where an [S, S] band was 16M entries a 4K row
        w_win = w.gather(-1, keys.clamp_min(0).expand(B, S, COLUMN_WINDOW))
        logw = torch.log(w_win.clamp_min(1e-6))
        window = -((logw * inside).sum(-1) / inside.sum(-1)).mean()
        run, indent = column_targets(ids, COLUMN_WINDOW)
        h0, h2 = self.outputs[OFFSET_LAYER], self.outputs[INDENT_LAYER]
        n = COLUMN_WINDOW + 1
        lo_run = self.columns["run"](h0).reshape(-1, n)
        lo_ind = self.columns["indent"](h2).reshape(-1, n)
        return {
            "window": window,
            "run": F.cross_entropy(lo_run, run.reshape(-1)),
            "indent": F.cross_entropy(lo_ind, indent.reshape(-1), ignore_index=-100)
            if (indent >= 0).any()
            else lo_ind.sum() * 0.0,
        }

    def key_copy_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of what head 0 of INDUCTION_LAYER would write from each key, in the
        unembedding's terms (its value, its o_proj columns, the final norm, lm_head), against
        that key's own id, at every position. The copy loss trains the same path only on the rows
        a copy document supervises (attention_supervision): there the head's attention found a
        needle's merged piece (`if`: 0.98) but its value named it first for a quarter of merged
        pieces and for 93% of characters (v4, v5; docs/trained_default.md)."""
        c = self.cfg
        heads = self.kv.view(*ids.shape, -1, c.qk_nope_head_dim + c.v_head_dim)
        v0 = heads[:, :, 0, c.qk_nope_head_dim :]  # [B, S, v_head_dim]: head 0's value
        lo = self._head0_logits(v0)
        return F.cross_entropy(lo.reshape(-1, lo.shape[-1]), ids.reshape(-1))

    def _head0_logits(self, v0: torch.Tensor) -> torch.Tensor:
        """[..., v_head_dim] -> [..., vocab]: what head 0 of INDUCTION_LAYER writes, in the
        unembedding's terms (its o_proj columns, the final norm on it alone, lm_head)."""
        w_o = self._layer(INDUCTION_LAYER).self_attn.o_proj.weight[:, : self.cfg.v_head_dim]
        return self.model.lm_head(self.model.model.norm(F.linear(v0, w_o)))

    def structure_losses(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The structure read-outs (structure.py) from INDENT_LAYER's output of the last
        `losses` call: the innermost open tag and the JSON context after each id."""
        rows = [structure_row(r, self.tok) for r in ids.tolist()]
        tag = torch.tensor([r[0] for r in rows])
        js = torch.tensor([r[1] for r in rows])
        h = self.outputs[INDENT_LAYER]
        return {
            "tag": F.cross_entropy(self.structure["tag"](h).flatten(0, 1), tag.flatten()),
            "json": F.cross_entropy(self.structure["json"](h).flatten(0, 1), js.flatten()),
        }

    def _lm_again(self, ids: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """The LM loss again on the ids where want [B, S] (bool), from the logits of the last
        `losses` call; 0 without any."""
        want = want[:, 1:]
        if not want.any():
            return torch.zeros(())
        return F.cross_entropy(self.logits[:, :-1][want], ids[:, 1:][want])

    def reply_loss(self, ids: torch.Tensor, reply: torch.Tensor) -> torch.Tensor:
        """The LM loss again on the assistant's ids of chat rows (reply [B, S] bool: whether ids
        [B, S] is the assistant's)."""
        return self._lm_again(ids, reply)

    def indent_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM loss again on the bytes that decide a line's indentation (indent_targets)."""
        return self._lm_again(ids, indent_targets(ids))

    def index_loss(self, induction: torch.Tensor) -> torch.Tensor:
        """The indexers' supervision: the induction key first (INDUCTION_LAYER's), the
        neighbours OFFSETS back first (every full indexer's)."""
        total = self._index_induction(induction >= 0, induction) + self._index_local()
        for key in self.lines or ():  # the line heads' keys, likewise
            total = total + self._index_induction(key >= 0, key) / len(LINE_HEADS)
        return total

    def _index_local(self) -> torch.Tensor:
        """-log softmax of every full indexer's scores at the keys OFFSETS back, on its KL rows:
        trained only by the KL, the indexers lost the neighbours beyond the lengths they were
        trained at (at 2K, layer 0 kept the previous byte in 15% of rows), and once sparse the KL
        cannot bring back a key it does not select."""
        total = 0.0
        for i in self.indexers:
            rows, scores, _ = self._layer(i).self_attn.indexer.last  # [B, R], [B, R, S]
            logp = torch.log_softmax(scores, dim=-1)
            for k in self.offsets:
                back = (rows - k).clamp_min(0)
                ok = (rows >= k) & (self.pos.gather(1, rows) - self.pos.gather(1, back) == k)
                lp = logp.gather(-1, back[..., None]).squeeze(-1)
                total = total - lp[ok].mean() / len(self.offsets)
        return total / len(self.indexers)

    def _index_induction(self, want: torch.Tensor, induction: torch.Tensor) -> torch.Tensor:
        """-log softmax of INDUCTION_LAYER's indexer scores at the induction key, on up to
        KL_ROWS rows of repeats per sequence: the KL alone (a small share of 8 heads' mass, and
        only over the selected keys once sparse) never taught it to select that key."""
        indexer = self._layer(INDUCTION_LAYER).self_attn.indexer
        B = want.shape[0]
        rows = torch.zeros(B, KL_ROWS, dtype=torch.long)
        keys = torch.zeros(B, KL_ROWS, dtype=torch.long)
        used = torch.zeros(B, KL_ROWS, dtype=torch.bool)
        for b in range(B):
            t = want[b].nonzero().squeeze(1)
            if len(t) > KL_ROWS:
                t = t[torch.randperm(len(t), generator=self.rows_gen)[:KL_ROWS]].sort().values
            rows[b, : len(t)], keys[b, : len(t)], used[b, : len(t)] = t, induction[b, t], True
        if not used.any():
            return torch.zeros(())
        logp = torch.log_softmax(indexer.scores_of(rows), dim=-1)  # [B, R, S]
        return -logp.gather(-1, keys[..., None]).squeeze(-1)[used].mean()

    def _count(self, i):
        def hook(mod, args, out):
            idx = out[2].reshape(-1)
            self.loads[i] = torch.bincount(idx, minlength=mod.weight.shape[0]).float()

        return hook

    def set_sparse(self, on: bool) -> None:
        for i in self.indexers:
            self._layer(i).self_attn.indexer.sparse = on

    def modules(self) -> tuple[torch.nn.Module, ...]:
        """Everything trained: the model, its MTP block and the training-only read-outs."""
        return (self.model, self.mtp, self.readout, self.columns, self.structure)

    def freeze_model(self, train: str) -> None:
        """Train everything ("all"), only the indexers ("indexers") or only the MTP layer less
        its indexer ("draft"): a Phase's `train`."""
        ix = {id(p) for p in self.indexer_parameters()}
        if train == "draft":
            keep = {id(p) for p in self.mtp.parameters()} - ix
        elif train == "indexers":
            keep = ix
        elif train == "all":
            keep = None
        else:
            raise ValueError(f"freeze_model({train!r}): train 'all', 'indexers' or 'draft'")
        for m in self.modules():
            for p in m.parameters():
                p.requires_grad_(keep is None or id(p) in keep)

    def _layer(self, i):
        n = self.cfg.num_hidden_layers
        return self.mtp.block if i == n else self.model.model.layers[i]

    def indexer_parameters(self) -> list[torch.nn.Parameter]:
        return [p for i in self.indexers for p in self._layer(i).self_attn.indexer.parameters()]

    def parameters(self):
        return [p for m in self.modules() for p in m.parameters() if p.requires_grad]

    def param_groups(self) -> list[dict]:
        """AdamW groups: decayed matrices, the rest, the induction layer's attention at
        INDUCTION_LR x the rate, and that layer's indexer at INDEXER_LR ("const")."""
        att = self._layer(INDUCTION_LAYER).self_attn
        index = {id(p) for p in att.indexer.parameters()}
        fast = {id(p) for p in att.parameters()} - index
        groups = {(d, f): [] for d in (True, False) for f in (0, 1, 2)}
        for p in self.parameters():
            groups[(p.dim() >= 2, 2 if id(p) in index else int(id(p) in fast))].append(p)
        # the induction layer's indexer learns only from its own losses (detached inputs), so it
        # takes INDEXER_LR without the cosine decay: it has a plateau too (8e-3 diverged)
        mult = {0: 1.0, 1: INDUCTION_LR, 2: 1.0}
        return [
            {"params": ps, "weight_decay": 0.1 if d else 0.0, "lr_mult": mult[f], "const": f == 2}
            for (d, f), ps in groups.items()
            if ps
        ]

    def indexer_kl(self) -> torch.Tensor:
        """KL(p || softmax(I)) per full-indexer layer, averaged over queries and layers."""
        n, types_ = self.cfg.num_hidden_layers, list(self.cfg.indexer_types) + ["full"]
        total = 0.0
        for i in self.indexers:
            group = [i] + [j for j in range(i + 1, n) if types_[j] == "shared"][: self._run(i)]
            rows, scores, sel = self._layer(i).self_attn.indexer.last
            p = sum(self.attn_probs[j] for j in group)
            p = p.gather(1, rows[..., None].expand(-1, -1, p.shape[-1]))
            if sel is not None:  # sparse: the KL over the selected set only
                keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, sel, True)
                scores = scores.masked_fill(~keep, float("-inf"))
                p = p.masked_fill(~keep, 0.0)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
            logq = torch.log_softmax(scores, dim=-1).clamp_min(-1e4)
            kl = (p * (torch.log(p.clamp_min(1e-20)) - logq)).sum(-1)
            total = total + kl.mean()
        return total / len(self.indexers)

    def _run(self, i: int) -> int:
        """How many shared layers follow full layer i (they reuse its selection)."""
        types_, k = list(self.cfg.indexer_types), 0
        for t in types_[i + 1 :]:
            if t != "shared":
                break
            k += 1
        return k

    def losses(
        self,
        ids: torch.Tensor,
        induction: torch.Tensor | None = None,
        pos: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """LM, MTP and indexer KL losses. With induction [B, S] (sparse joint steps) every full
        indexer's selection keeps the keys its supervision names (forced_keys); pos [B, S]: the
        rows' position ids (skip_positions; default 0..S-1)."""
        B, S = ids.shape
        self.lines = line_keys(ids) if self.line_heads else None
        for i in self.indexers:  # not the MTP layer's (S - 1 rows, no supervised heads)
            main = i < self.cfg.num_hidden_layers and induction is not None
            extra = self.lines if self.lines is not None and i == INDENT_LAYER else ()
            force = forced_keys(induction, i == INDUCTION_LAYER, extra) if main else None
            self._layer(i).self_attn.indexer.force = force
        m = self.model.model
        if pos is None:
            pos, mask = torch.arange(S).unsqueeze(0).expand(B, S), None
        else:  # an explicit mask: transformers reads a jump in position ids without one as the
            # start of another packed sequence and masks everything before it
            mask = torch.ones_like(ids)
        self.pos = pos
        out = m(input_ids=ids, position_ids=pos, attention_mask=mask)
        h = out.last_hidden_state
        logits = self.model.lm_head(h)
        self.logits = logits  # attention_supervision reads them on the rows of repeats
        lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        # MTP: row i reads h_i and embed(t_{i+1}), predicts t_{i+2}
        emb = m.embed_tokens(ids[:, 1:])
        pe = m.rotary_emb(h, position_ids=pos[:, : S - 1])
        mask = torch.full((S - 1, S - 1), torch.finfo(h.dtype).min).triu(1)[None, None]
        hm = self.mtp(emb, h[:, :-1], pe, mask.expand(B, 1, S - 1, S - 1), pos[:, : S - 1])
        ml = self.model.lm_head(hm)
        mtp = F.cross_entropy(ml[:, :-1].reshape(-1, ml.shape[-1]), ids[:, 2:].reshape(-1))
        kl = self.indexer_kl()
        return {"lm": lm, "mtp": mtp, "mtp_kl": mtp_distill(ml, logits), "kl": kl}

    @contextlib.contextmanager
    def generating(self):
        """The model as transformers serves it (eval, its own cached DSA indexers), for greedy
        continuations; the trainer's indexers are back on exit."""
        ixs = [self._layer(i).self_attn.indexer for i in self.indexers]
        for ix in ixs:
            del ix.forward  # the class's: transformers' indexer, with its cache
        self.model.eval()
        try:
            yield self.model
        finally:
            for ix in ixs:
                ix.forward = types.MethodType(_indexer_forward, ix)
            self.model.train()

    def greedy_continuations(
        self, prompts: list[list[int]], grammars: list | None = None
    ) -> list[list[int]]:
        """The model's greedy continuation of each prompt (unloop.greedy: transformers' cached
        decoding with its own indexers; the trainer's are back after, nothing forced); with
        grammars (a GrammarSpec or None per prompt), each held to its grammar as served."""
        grammars = grammars or [None] * len(prompts)
        with self.generating() as m:
            conts = [
                unloop.greedy(m, p, matcher=g and self._matcher(g))
                for p, g in zip(prompts, grammars, strict=True)
            ]
        for i in self.indexers:
            self._layer(i).self_attn.indexer.force = None
        return conts

    def greedy_rows(self, prompts: list[list[int]]) -> torch.Tensor:
        """[len(prompts), S]: each prompt and the model's greedy continuation of it (unloop.greedy,
        transformers' cached decoding, the indexers selecting alone), cut to the shortest row (no
        padding for the draft to learn). The draft phase's rows with --draft-greedy: the text the
        draft meets when it serves greedy decoding, where the data's text is another
        distribution (p1e: agreement 0.675 teacher-forced on held-out text, 0.606 greedy)."""
        full = [p + c for p, c in zip(prompts, self.greedy_continuations(prompts))]
        S = min(map(len, full))
        return torch.tensor([f[:S] for f in full])

    def _matcher(self, spec):
        from dist_glm5.sampling.grammar import GrammarMatcher

        return GrammarMatcher(spec, self.tok, self.model.config.vocab_size, (unloop.EOS,))

    def unloop_loss(
        self, prompts: list[list[int]], grammars: list | None = None
    ) -> tuple[torch.Tensor, int]:
        """The sequence-level unlikelihood loss (unloop.py) on the model's greedy continuations of
        prompts, and how many ids of them are marked (a loop's; with grammars, each continuation
        held to its grammar, also an empty value or a repeated key: unloop.value_marks). One
        batch, the rows padded after their end (nothing there is marked), no forced keys (the
        indexers select alone, as they serve)."""
        grammars = grammars or [None] * len(prompts)
        full = [pr + c for pr, c in zip(prompts, self.greedy_continuations(prompts, grammars))]
        S = max(map(len, full))
        rows = [f + [unloop.EOS] * (S - len(f)) for f in full]
        marks = []
        for f, pr, g in zip(full, prompts, grammars):
            mk = unloop.loop_marks(f, start=len(pr))
            if g is not None:
                vm = unloop.value_marks(self.tok, f, len(pr), json_keys=g.kind != "tool_calls")
                mk = [a or b for a, b in zip(mk, vm)]
            marks.append(mk + [False] * (S - len(f)))
        n = sum(map(sum, marks))
        if not n:
            return torch.zeros(()), 0
        ids = torch.tensor(rows)
        logits = self.model(input_ids=ids).logits
        return unloop.unlikelihood(logits, ids, torch.tensor(marks)), n

    @torch.no_grad()
    def balance(self) -> None:
        for i, gate in self.routers.items():
            load = self.loads.get(i)
            if load is not None:
                gate.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)

    # ---- export -------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight under its checkpoint name, experts split per expert (as save_pretrained
        writes them)."""
        n = self.cfg.num_hidden_layers
        named = dict(self.model.state_dict())
        names = {k: k for k in named}
        mtp_names = self.mtp.hf_names(n)
        for k, v in self.mtp.state_dict().items():
            named["mtp." + k] = v
            names["mtp." + k] = mtp_names[k]
        out = {}
        I = self.cfg.moe_intermediate_size
        for k, v in named.items():
            name = names[k]
            if name.endswith("mlp.experts.gate_up_proj"):
                pre = name[: -len("gate_up_proj")]
                for e in range(v.shape[0]):
                    out[f"{pre}{e}.gate_proj.weight"] = v[e, :I]
                    out[f"{pre}{e}.up_proj.weight"] = v[e, I:]
            elif name.endswith("mlp.experts.down_proj"):
                pre = name[: -len("down_proj")]
                for e in range(v.shape[0]):
                    out[f"{pre}{e}.down_proj.weight"] = v[e]
            else:
                out[name] = v
        return {k: v.detach().clone().contiguous() for k, v in out.items()}


# ---- data --------------------------------------------------------------------------------------
class Data:
    def __init__(
        self,
        seed: int,
        reindent: bool = False,
        tok: ByteTokenizer | None = None,
        inner_spaces: int = 0,
        code_share: float = 0.0,
        simple_code: float = 0.0,
        relative_paths: bool = False,
        copy_pieces: bool = False,
        needle_decoys: int = 0,
        unloop_json: int = 0,
        unloop_json_fresh: bool = False,
    ):
        from . import chat_corpus, corpus

        self.mixes = code_mixes(code_share)  # checked before the corpus loads
        if not 0.0 <= simple_code <= 1.0:
            raise ValueError(
                f"simple_code is a share of the plain code rows, 0 to 1; got {simple_code}"
            )
        self.simple_code = simple_code  # the share of plain code rows from simple_code.module
        self.corpus, self.chat = corpus, chat_corpus
        self.tok = tok or ByteTokenizer()  # rows of its ids (bytes, or runs and tags merged)
        if copy_pieces and not self.bpe:  # checked before the corpus loads
            raise ValueError("copy_pieces draws the repeats from a BPE vocabulary's pieces: bpe")
        # the repeats' strings hold merged word pieces too (corpus.repeat_training_doc)
        self.repeat_pieces = corpus.copy_pieces(self.tok.merged) if copy_pieces else ()
        if needle_decoys < 0 or unloop_json < 0:
            raise ValueError(
                f"needle_decoys, unloop_json: counts, not {needle_decoys}, {unloop_json}"
            )
        self.needle_decoys = needle_decoys  # never-asked needles per needle document
        self.unloop_json = unloop_json  # more JSON prompts per unloop step (unloop_batch)
        self.unloop_json_fresh = unloop_json_fresh  # ...each a chat's first message
        files = corpus.load_split("train")
        if reindent:  # the code's indentation as the column read-outs count it (corpus.reindent)
            files = [(r, corpus.reindent(b, cap=COLUMN_WINDOW)) for r, b in files]
        if inner_spaces:  # runs of spaces inside a line cut short (corpus.squeeze_inner_spaces)
            files = [(r, corpus.squeeze_inner_spaces(b, inner_spaces)) for r, b in files]
        self.text = b"\n".join(b for _, b in files)
        self.seed = seed
        self.words = chat_corpus.Words.from_text(self.text, relative_paths=relative_paths)
        log.info("train corpus: %d files, %.1f MB", len(files), len(self.text) / 1e6)

    def window(self, rng: random.Random, n: int) -> bytes:
        start = rng.randrange(0, len(self.text) - n)
        return self.text[start : start + n]

    def row(self, rng: random.Random, n: int, mix: str) -> tuple[list[int], list[int], list[bool]]:
        """(token ids, induction target per byte: the key head 0 of INDUCTION_LAYER should read, -1
        where the byte is not inside a repeat, whether the id is an assistant's (chat rows))."""
        f, u = self.mixes[mix], rng.random()
        src = None
        m = self.row_bytes(n)  # bytes enough for n ids once merged
        if u < f["needle"]:

            def needles(nb: int):
                if rng.random() < 0.5:
                    filler = self.window(rng, nb)
                else:
                    filler = self.corpus.prose_filler(rng, nb, classic=rng.random() < 0.3)
                k = rng.choice([2, 3, 4, 6, 8])
                return self.corpus.needle_training_doc(rng, filler, k, self.needle_decoys)

            doc, src = self.fit(rng, needles, n) if self.bpe else needles(n)
        elif u < f["needle"] + f["copy"]:
            text = self.window(rng, m if self.bpe else n)
            doc, src = self.corpus.copy_training_doc(rng, text, rng.choice([1, 2, 3]))
        elif u < f["needle"] + f["copy"] + f["repeat"]:
            nb = m if self.bpe else n
            window = self.window(rng, nb)
            doc, src = self.corpus.repeat_training_doc(rng, window, nb, self.repeat_pieces)
        elif u < f["needle"] + f["copy"] + f["repeat"] + f["chat"]:
            ids, src, reply = self.chat.chat_row(rng, self.words, m, self.text)  # <eos> in ids
            return self._row(ids, src, reply, n)
        elif self.simple_code and rng.random() < self.simple_code:
            doc = simple_code.module(rng, m)
        else:
            doc = self.window(rng, m)
        src = list(src or []) + [-1] * (len(doc) - len(src or []))
        return self._row(list(doc), src, [False] * len(doc), n)

    @property
    def bpe(self) -> bool:
        return isinstance(self.tok, BpeTokenizer)

    def row_bytes(self, n: int) -> int:
        """Bytes enough for n ids once merged: BPE pieces hold about 2.7 bytes of code, 2 of
        the chats' words and 1.5 of the needles' random values."""
        if self.bpe:
            return 4 * n
        return n + n // 2 if self.tok.merges else n

    def fit(self, rng: random.Random, build, n: int):
        """build(n_bytes)'s document (drawn from rng) at the most bytes that merge to at most n
        ids (a needle document asks its needles at the end: cut, it would not). The rng is
        replayed from the same state for each try, so a row stays a function of seed and step."""
        state, nb = rng.getstate(), 3 * n
        for _ in range(6):
            rng.setstate(state)
            doc, src = build(nb)
            k = len(self.tok.merge(list(doc))[0])
            if k <= n:
                return doc, src
            nb = int(nb * n / k * 0.97)
        raise RuntimeError(f"no document of {n} ids after 6 tries (last {k} ids, {nb} bytes)")

    def _row(self, ids: list[int], src: list[int], reply: list[bool], n: int):
        """A row of n ids (runs and tags merged, padded with newlines or cut) and its targets."""
        if self.tok.merges:
            ids, src, reply = merged_row(ids, src, reply, self.tok)
        pad = max(0, n - len(ids))
        ids, src = (ids + [10] * pad)[:n], (src + [-1] * pad)[:n]
        return ids, induction_targets(ids, src), (reply + [False] * pad)[:n]

    def unloop_prompts(self, step: int) -> list[list[int]]:
        """UNLOOP_ROWS prompts of step (code windows, then chats up to the assistant's turn)."""
        return self.unloop_batch(step)[0]

    def unloop_batch(self, step: int, grammar: bool = False) -> tuple[list[list[int]], list]:
        """unloop_prompts(step) and, with grammar, the grammar each one's reply would be served
        under (None for code and free replies; unloop.chat_prompt_grammar), every other chat
        prompt then ending at a JSON reply (unloop.json_prompt_grammar; else about 1 in 20 would).
        Without grammar, no grammars (all None). With unloop_json, that many more prompts end at
        a JSON reply (held to json_object where the grammar is on); with unloop_json_fresh, each
        is a chat's first message alone (unloop.json_prompt_fresh), not after packed chats."""
        rng = random.Random(f"unloop:{self.seed}:{step}")
        n_code, n_chat = UNLOOP_ROWS
        code = [unloop.code_prompt(rng, self.text) for _ in range(n_code)]
        chats = [
            (unloop.json_prompt_grammar if grammar and i % 2 else unloop.chat_prompt_grammar)(
                rng, self.words
            )
            for i in range(n_chat)
        ]
        # drawn after the committed recipe's prompts, which stay the same
        more = unloop.json_prompt_fresh if self.unloop_json_fresh else unloop.json_prompt_grammar
        chats += [more(rng, self.words) for _ in range(self.unloop_json)]
        prompts = code + [ids for ids, _ in chats]
        if self.tok.merges:  # the ids the model reads (a prompt then holds fewer than PROMPT)
            prompts = [self.tok.merge(p)[0] for p in prompts]
        return prompts, [None] * n_code + [g if grammar else None for _, g in chats]

    def batch(self, step: int, seq: int, batch: int, mix: str = "base"):
        """(ids [batch, seq], induction targets [batch, seq], assistant's ids [batch, seq])."""
        rng = random.Random(self.seed * 1_000_003 + step)
        rows = [self.row(rng, seq, mix) for _ in range(batch)]
        return tuple(torch.tensor([r[i] for r in rows]) for i in range(3))


def mtp_distill(draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(main || draft), mean over rows: draft [B, S-1, V] (row i drafts t_{i+2}), logits
    [B, S, V] of the main model (row i + 1 predicts t_{i+2}), detached: the teacher."""
    teacher = torch.log_softmax(logits[:, 1:].detach().float(), -1)
    q = torch.log_softmax(draft.float(), -1)
    return (teacher.exp() * (teacher - q)).sum(-1).mean()


def merged_row(
    ids: list[int], src: list[int], reply: list[bool], tok: ByteTokenizer
) -> tuple[list[int], list[int], list[bool]]:
    """A row of bytes (special ids among them), its source map and its assistant mask, with
    its space runs and tags merged into tok's ids: the source map then points at the id that
    holds the source byte."""
    out, starts = tok.merge(ids)
    where = [0] * len(ids)
    for t, (a, b) in enumerate(zip(starts, [*starts[1:], len(ids)], strict=True)):
        where[a:b] = [t] * (b - a)
    return out, [where[src[a]] if src[a] >= 0 else -1 for a in starts], [reply[a] for a in starts]


def structure_row(ids: list[int], tok: ByteTokenizer) -> tuple[list[int], list[int]]:
    """structure_targets of a row of tok's ids, scanned as the bytes they hold (a run its
    spaces, a tag its text): the state after an id is the state after its last byte."""
    tb, flat, last = tok.token_bytes(), [], []
    for i in ids:
        flat += list(tb[i]) if i >= FIRST_RUN_ID else [i]
        last.append(len(flat) - 1)
    tag, js = structure_targets(flat)
    return [tag[j] for j in last], [js[j] for j in last]


def induction_targets(doc: bytes, src: list[int]) -> list[int]:
    """Row t repeats the byte at src[t] and the next byte repeats the one after it: the key the
    induction head should read at t is src[t] + 1 (it holds the byte to predict)."""
    n = len(doc)
    out = [-1] * n
    for t in range(n - 1):
        s = src[t]
        if 0 <= s and src[t + 1] == s + 1 and doc[t] == doc[s] and doc[t + 1] == doc[s + 1]:
            out[t] = s + 1
    return out


class Lines(NamedTuple):
    """A row's lines, per byte ([B, S] each), as the column, indent and line targets read them."""

    t: torch.Tensor  # the byte's position
    space: torch.Tensor
    newline: torch.Tensor
    last_nl: torch.Tensor  # the newline at or before t (-1: none in the row)
    last_other: torch.Tensor  # the last non-space at or before t (newlines count)
    start: torch.Tensor  # where t's line starts (t itself on a newline: the next line)
    lead: torch.Tensor  # t is a line's newline or a leading space of a line begun in the row


def lines_of(ids: torch.Tensor) -> Lines:
    B, S = ids.shape
    t = torch.arange(S).expand(B, S)
    space, newline = ids == 32, ids == 10
    last_nl = torch.where(newline, t, -1).cummax(1).values
    last_other = torch.where(space, -1, t).cummax(1).values
    start = torch.where(newline, t + 1, last_nl + 1)
    # a row opening mid-line: its first line's start is not seen, nor its leading spaces
    lead = newline | (space & (last_other < start) & (last_nl >= 0))
    return Lines(t, space, newline, last_nl, last_other, start, lead)


def column_targets(ids: torch.Tensor, clip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, S] -> (run, indent), each [B, S]: run[t] = how many spaces end at t (t included);
    indent[t] = how many spaces open the line that t's newline or leading spaces belong to (on
    those rows; -100 elsewhere, on the row's first line and where the spaces run past the row);
    both clipped at clip."""
    S = ids.shape[1]
    L = lines_of(ids)
    run = (L.t - L.last_other).clamp_max(clip)
    # a line's leading spaces end at the first non-space at or after its start
    nxt_other = torch.where(L.space, S, L.t).flip(1).cummin(1).values.flip(1)
    end = nxt_other.gather(1, L.start.clamp_max(S - 1)) if S else L.start
    end = torch.where(L.start >= S, S, end)
    indent = torch.where(L.lead & (end < S), (end - L.start).clamp_max(clip), -100)
    return run, indent


def indent_targets(ids: torch.Tensor) -> torch.Tensor:
    """ids [B, S] -> [B, S] bool: the bytes that decide how far a line is indented: its leading
    spaces and the byte after them (its first non-space, or the newline of a blank line), on
    lines that start inside the row."""
    L = lines_of(ids)
    prev_lead = torch.zeros_like(L.lead)
    prev_lead[:, 1:] = L.lead[:, :-1]
    return (L.lead & L.space) | (~L.space & prev_lead)


def line_keys(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, S] -> (indent_key, end_key), each [B, S], -1 where none: on a line's newline and
    leading spaces (the rows column_targets' indent names), the last indentation byte of the
    previous non-blank line (the byte before its first non-space: a space, or its newline) and
    the last byte before the line other than spaces and newlines; -1 elsewhere, and for lines
    whose previous line started before the row."""
    B = ids.shape[0]
    L = lines_of(ids)
    code = ~L.space & ~L.newline
    last_code = torch.where(code, L.t, -1).cummax(1).values
    # a non-blank line's first non-space: code, after a newline seen in the row, nothing but
    # spaces between
    prev_code = torch.cat([torch.full((B, 1), -1), last_code[:, :-1]], 1)
    first = code & (L.last_nl >= 0) & (prev_code < L.last_nl)
    last_first = torch.where(first, L.t, -1).cummax(1).values
    before = (L.start - 1).clamp_min(0)
    f = torch.where(L.start > 0, last_first.gather(1, before), -1)
    end = torch.where(L.start > 0, last_code.gather(1, before), -1)
    indent_key = torch.where(L.lead & (f > 0), f - 1, -1)
    end_key = torch.where(L.lead & (f > 0), end, -1)  # the same rows: a line seen whole
    return indent_key, end_key


def phase_of(step: int, plan: list[Phase] = PHASES) -> Phase:
    for ph in plan:
        if step < ph.end:
            return ph
    return plan[-1]


def lr_at(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def set_rates(opt, ph: Phase, step: int, model_steps: int, lr: float) -> None:
    """Every AdamW group's rate at step: constant in the draft, indexers' and unloop phases and
    for the induction layer's indexer ("const"), the cosine of the model's phases otherwise."""
    for g in opt.param_groups:
        if ph.train == "draft":
            g["lr"] = DRAFT_LR
        elif g["const"] or ph.train == "indexers":
            g["lr"] = INDEXER_LR
        elif ph.unlikelihood:
            g["lr"] = g["lr_mult"] * UNLOOP_LR
        else:
            g["lr"] = g["lr_mult"] * lr_at(step, model_steps, lr)


# ---- the run -----------------------------------------------------------------------------------
def step_rows(tr, data, step: int, ph: Phase, seed: int, skip_p: float, draft_greedy: bool):
    """A step's (ids, induction targets, assistant's ids, position ids or None): the data's batch
    (Data.batch; positions with skips when skip_p), or in the draft phase with draft_greedy the
    model's greedy rows (Trainer.greedy_rows: nothing forced, no skips)."""
    if ph.train == "draft" and draft_greedy:
        return tr.greedy_rows(data.unloop_prompts(step)), None, None, None
    (seq, batch) = ph.shape(step)
    ids, induction, reply = data.batch(step, seq, batch, ph.mix)
    pos = skip_positions(seed, step, batch, seq, skip_p) if skip_p else None
    return ids, induction, reply, pos


def train(
    out: Path,
    *,
    steps: int | None = None,
    lr: float = 2e-3,
    seed: int = 0,
    threads: int = 1,
    save_every: int = 25,
    export_to: Path | None = None,
    skip_p: float = 0.0,
    indent_weight: float = 0.0,
    line_heads: bool = False,
    base_extra: int = 0,
    unloop_steps: int = 0,
    unloop_at: str = "end",
    reindent: bool = False,
    inner_spaces: int = 0,
    space_runs: int = 0,
    chat_tags: bool = False,
    space_unit: int = 0,
    bpe: int = 0,
    offset_heads: int = len(OFFSETS),
    kv_lora_rank: int = TRAIN_CONFIG["kv_lora_rank"],
    match_head: bool = False,
    copy_direct: float = 0.0,
    copy_direct_on: str = "all",
    draft_greedy: bool = False,
    unloop_grammar: bool = False,
    code_share: float = 0.0,
    simple_code: float = 0.0,
    relative_paths: bool = False,
    copy_pieces: bool = False,
    key_copy: bool = False,
    needle_decoys: int = 0,
    unloop_json: int = 0,
    unloop_json_fresh: bool = False,
) -> None:
    """Train (resuming from `out`/state.pt when it is there) to `steps` (default: every phase),
    logging one JSON line per step to `out`/train.log; with `export_to`, write the shipped
    checkpoint there when done. skip_p: the share of rows whose position ids jump
    (skip_positions; 0: none, the committed recipe); indent_weight: the bytes that decide a
    line's indentation (indent_targets) count 1 + indent_weight times in the LM loss (0: the
    committed recipe); line_heads: supervise LINE_HEADS (off: the committed recipe); base_extra:
    steps added to the base phase (phases; 0: the committed recipe); unloop_steps: the "unloop"
    phase's steps (phases; 0: none, the committed recipe), unloop_at where it goes (phases);
    reindent: the training code re-indented by corpus.reindent (off: the committed recipe);
    inner_spaces: the training code's runs of spaces inside a line cut to at most this many
    (corpus.squeeze_inner_spaces; 0: unchanged, the committed recipe; data, not a shape);
    space_runs, chat_tags, space_unit: the vocabulary of ByteTokenizer(space_runs, chat_tags,
    space_unit) (0, false, 0: bytes, the committed recipe); offset_heads: 4 for OFFSETS_FAR
    (space ids only; 3: OFFSETS, the committed recipe); kv_lora_rank: the width of MLA's
    compressed KV (64: the committed recipe); match_head: supervise MATCH_HEAD (off: the
    committed recipe); copy_direct: the share of the copy loss on the induction head's share of
    the logits, from the base phase on (Trainer; 0: the committed recipe; a loss, not a shape,
    so a resume does not check it), on every row ("all") or on the documents' rows only ("docs":
    not chat rows, which are the rows holding an assistant's id); draft_greedy: the draft phase
    trains on the model's greedy continuations of code and chat prompts (Trainer.greedy_rows)
    instead of the data's rows (off: the committed recipe; data, not a shape: a run may switch
    it on when it resumes); unloop_grammar: the unloop phase continues its chat prompts under
    the grammar each reply would be served with, and pushes down empty values and repeated keys
    besides loops (Data.unloop_batch, unloop.value_marks; off: the committed recipe; data, like
    draft_greedy); code_share: the plain code's share of the base and long mixes (code_mixes;
    0: the committed recipe; data); simple_code: the share of the plain code rows that are
    generated modules (simple_code.module; 0: the committed recipe; data); relative_paths: the
    chats' path values without their leading "/" (chat_corpus.Words; off: the committed recipe;
    data); copy_pieces: the repeat documents' strings hold the BPE vocabulary's merged word
    pieces besides characters (corpus.repeat_training_doc; bpe only; off: the committed recipe;
    data); key_copy: add Trainer.key_copy_loss where the model trains with the supervision
    (off: the committed recipe; a loss, not a shape, as copy_direct); needle_decoys: never-asked
    needles per needle document whose values begin as an asked one's (corpus.decoy_needles; 0:
    the committed recipe; data); unloop_json: more prompts ending at a JSON reply per unloop
    step (Data.unloop_batch; 0: the committed recipe; data); unloop_json_fresh: each of those a
    chat's first message alone (off: after packed chats, as v7; data)."""
    if copy_direct_on not in ("all", "docs"):
        raise ValueError(f"copy_direct_on is 'all' or 'docs', not {copy_direct_on!r}")
    from tqdm import tqdm

    plan = phases(base_extra, unloop_steps, unloop_at)
    steps = plan[-1].end if steps is None else steps
    torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    offsets = {len(OFFSETS): OFFSETS, len(OFFSETS_FAR): OFFSETS_FAR}[offset_heads]
    shape = RunShape(space_runs, chat_tags, offsets, kv_lora_rank, match_head, space_unit, bpe)
    tr = shape.trainer(seed, line_heads, copy_direct)
    tr.key_copy = key_copy
    data = Data(
        seed,
        reindent,
        tr.tok,
        inner_spaces,
        code_share,
        simple_code,
        relative_paths,
        copy_pieces,
        needle_decoys,
        unloop_json,
        unloop_json_fresh,
    )
    opt = torch.optim.AdamW(tr.param_groups(), lr=lr, betas=(0.9, 0.95))
    state_path = out / "state.pt"
    step = resume(tr, opt, state_path, shape) if state_path.exists() else 0
    logf = open(out / "train.log", "a")
    # the cosine runs over the phases that train the model (the unloop phase at its own rate)
    cosine = [ph.end for ph in plan if ph.train == "all" and not ph.unlikelihood]
    model_steps = min(steps, max(cosine))
    # the indexers are separate learners (detached inputs): their own clip, so their
    # supervision does not shrink the model's step (taken before any freeze_model, so every
    # parameter; frozen ones later have no grad and are not clipped)
    indexer_params = tr.indexer_parameters()
    ix = {id(p) for p in indexer_params}
    model_params = [p for p in tr.parameters() if id(p) not in ix]
    bar = tqdm(total=steps, initial=step, desc="train", dynamic_ncols=True)
    t0 = time.time()
    while step < steps:
        ph = phase_of(step, plan)
        sparse = ph.sparse
        indexers_only, draft_only = ph.train == "indexers", ph.train == "draft"
        tr.set_sparse(sparse)
        # the direct copy loss from the base phase on: from the first step (m2a) it held the
        # copy loss near 3.7 nats and lm_copy 0.7 behind m1 at step 500; the drill phase keeps
        # the normalised form, which forms the copy first
        tr.copy_direct = copy_direct if ph.mix != "drill" else 0.0
        tr.freeze_model(ph.train)
        set_rates(opt, ph, step, model_steps, lr)
        ids, induction, reply, pos = step_rows(tr, data, step, ph, seed, skip_p, draft_greedy)
        tr.rows_gen.manual_seed(seed * 1_000_003 + step)
        tr.model.train()
        ul = None
        if ph.unlikelihood:  # first: its forwards overwrite what the hooks keep for the others
            ul, marked = tr.unloop_loss(*data.unloop_batch(step, unloop_grammar))
        ls = tr.losses(ids, induction if sparse and not indexers_only else None, pos)
        if indexers_only:  # the indexers' own losses: the model's are not trained here
            ls["index"] = tr.index_loss(induction)
            loss = ls["kl"] + ls["index"]
        elif draft_only:  # the draft's: next-next byte and the main model's distribution there
            loss = ls["mtp"] + MTP_DISTILL * ls["mtp_kl"]
        else:
            docs = ~reply.any(1) if copy_direct_on == "docs" else None
            ls.update(tr.attention_supervision(ids, induction, docs))
            ls.update(tr.structure_losses(ids))
            ls["reply"] = tr.reply_loss(ids, reply)
            mtp = ls["mtp"] + MTP_DISTILL * ls["mtp_kl"]
            loss = ls["lm"] + MTP_WEIGHT * mtp + ls["kl"] + sum(ls[k] for k in SUPERVISION)
            loss = loss + sum(ls[k] for k in LINE_LOSSES if k in ls)
            loss = loss + REPLY_WEIGHT * ls["reply"]
            loss = loss + ls.get("key_copy", 0.0)
            if indent_weight:
                ls["indent_lm"] = tr.indent_loss(ids)
                loss = loss + indent_weight * ls["indent_lm"]
            if ul is not None:
                ls["unloop"] = ul
                loss = loss + ph.unlikelihood * ul
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model_params, 1.0)
        gi = torch.nn.utils.clip_grad_norm_(indexer_params, 1.0)
        opt.step()
        if ph.train == "all":
            tr.balance()
        step += 1
        rec = {k: round(v.item(), 4) for k, v in ls.items()}
        if ul is not None:
            rec["marked"] = marked
        rec.update(
            step=step,
            seq=ids.shape[1],
            sparse=sparse,
            gn=round(gn.item(), 3),
            gi=round(gi.item(), 3),
        )
        rec["s"] = round(time.time() - t0, 1)
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        bar.set_postfix(lm=rec["lm"], kl=rec["kl"], mtp=rec["mtp"], seq=ids.shape[1])
        bar.update(1)
        if step % save_every == 0 or step == steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save(
                {
                    "model": tr.model.state_dict(),
                    "mtp": tr.mtp.state_dict(),
                    "readout": tr.readout.state_dict(),
                    "columns": tr.columns.state_dict(),
                    "structure": tr.structure.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    **shape.state(),
                },
                tmp,
            )
            tmp.replace(state_path)
    bar.close()
    if export_to:
        export(tr, Path(export_to))


def resume(tr: Trainer, opt, state_path: Path, shape: RunShape) -> int:
    """Load a run's saved state into `tr` and `opt`; returns its step."""
    st = torch.load(state_path, weights_only=False)
    saved = RunShape.of_state(st)
    if saved != shape:
        raise ValueError(
            f"{state_path} was trained with {saved.flags()}; resume it with the same "
            f"(asked: {shape.flags()})"
        )
    load_state(tr, state_path, st)
    opt.load_state_dict(st["opt"])
    log.info("resumed at step %d", st["step"])
    return st["step"]


@dataclass(frozen=True)
class RunShape:
    """What a run's weights are shaped by (its state.pt records it; a resume must be given the
    same): the vocabulary, the offset heads, MLA's latent width and the match head. States saved
    before a field was recorded read the committed recipe's value."""

    space_runs: int = 0
    chat_tags: bool = False
    offsets: tuple[int, ...] = OFFSETS
    kv_lora_rank: int = TRAIN_CONFIG["kv_lora_rank"]
    match_head: bool = False
    space_unit: int = 0
    bpe: int = 0  # a BPE vocabulary of this many ids (checkpoint/bpe.py), 0: bytes

    def __post_init__(self) -> None:
        if self.bpe and (self.space_runs or self.space_unit or self.chat_tags):
            raise ValueError(
                "--bpe is a vocabulary of its own (the chat tags among its ids): drop "
                "--space-runs, --space-unit and --chat-tags"
            )

    @classmethod
    def of_state(cls, st: dict) -> RunShape:
        known = {f.name for f in dataclasses.fields(cls)}
        shape = cls(**{k: v for k, v in st.items() if k in known})
        return dataclasses.replace(shape, offsets=tuple(shape.offsets))

    def state(self) -> dict:
        """The fields as state.pt keeps them."""
        return dataclasses.asdict(self)

    def tokenizer(self) -> ByteTokenizer:
        if self.bpe:
            from .corpus import bpe

            return bpe(self.bpe)
        return ByteTokenizer(self.space_runs, self.chat_tags, self.space_unit)

    def trainer(self, seed: int, line_heads: bool = False, copy_direct: float = 0.0) -> Trainer:
        tok = self.tokenizer()
        cfg = hf_config(train_config(tok, self.kv_lora_rank))
        return Trainer(cfg, seed, line_heads, tok, self.offsets, self.match_head, copy_direct)

    def flags(self) -> str:
        """train-default's flags for this shape; the committed recipe's values are left out."""
        out = [f"--space-runs {self.space_runs}"] + (["--chat-tags"] if self.chat_tags else [])
        if self.space_unit:
            out.append(f"--space-unit {self.space_unit}")
        if self.bpe:
            out.append(f"--bpe {self.bpe}")
        if self.offsets != OFFSETS:
            out.append(f"--offset-heads {len(self.offsets)}")
        if self.kv_lora_rank != TRAIN_CONFIG["kv_lora_rank"]:
            out.append(f"--kv-lora-rank {self.kv_lora_rank}")
        return " ".join(out + (["--match-head"] if self.match_head else []))


def load_state(tr: Trainer, state_path: Path, st: dict | None = None) -> dict:
    """Load a run's saved weights into `tr`; returns the saved state (its "opt" and "step")."""
    st = torch.load(state_path, weights_only=False) if st is None else st
    tr.model.load_state_dict(st["model"])
    tr.mtp.load_state_dict(st["mtp"])
    tr.readout.load_state_dict(st["readout"])
    if "columns" in st:  # runs started before the column read-outs start them fresh
        tr.columns.load_state_dict(st["columns"])
    if "structure" in st:  # likewise the structure read-outs
        tr.structure.load_state_dict(st["structure"])
    return st


def export_state(out: Path, dst: Path, seed: int) -> int:
    """Export a run's last saved step (`out`/state.pt) without training on: to gate a run as it
    goes. Returns that step."""
    state_path = Path(out) / "state.pt"
    if not state_path.exists():
        raise FileNotFoundError(
            f"{state_path} does not exist: --export-only exports a run's saved state; "
            "train first (the same command without --export-only)"
        )
    st = torch.load(state_path, weights_only=False)
    tr = RunShape.of_state(st).trainer(seed)
    step = load_state(tr, state_path, st)["step"]
    export(tr, Path(dst))
    log.info("exported step %d of %s", step, out)
    return step


def export(tr: Trainer, dst: Path) -> None:
    """The shipped checkpoint: config.json, the byte tokenizer (ours, and as transformers'
    tokenizer.json), bf16 weights (the router in fp32: both runtimes keep it there)."""
    from dist_glm5.checkpoint.safetensors_io import save_streaming
    from dist_glm5.checkpoint.tokenizer import write_tokenizer_files

    dst.mkdir(parents=True, exist_ok=True)
    sd = tr.hf_state_dict()
    fp32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
    sd = {k: v.float() if k.endswith(fp32) else v.to(torch.bfloat16) for k, v in sd.items()}
    raw = train_config(tr.tok, tr.model.config.kv_lora_rank)
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_tokenizer_files(dst, tr.tok)
    save_streaming(dst / "model.safetensors", sd, metadata={"format": "pt"})
    log.info("exported %d tensors to %s", len(sd), dst)
    rep = {"heldout_loss_test_slice": heldout_loss(dst), "test_slice": TEST_SLICE}
    (dst / "train_report.json").write_text(json.dumps(rep, indent=1) + "\n")
    log.info("held-out loss of the exported weights: %s", rep)


TEST_SLICE = "heldout.json texts 0 and 1, first 1024 bytes each"


def heldout_loss(model_dir: Path) -> float:
    """Mean next-byte cross-entropy (nats) of the exported weights on the test slice, computed by
    transformers in fp32 (the figure tests/test_trained_default.py checks our runtime against).
    With space-run or tag ids: the ids' cross-entropy summed, per byte they predict."""
    import tempfile

    from transformers import GlmMoeDsaForCausalLM

    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    from .corpus import frozen_heldout
    from .hf import hf_copy

    with tempfile.TemporaryDirectory() as tmp:
        ref = GlmMoeDsaForCausalLM.from_pretrained(
            hf_copy(model_dir, Path(tmp)), dtype=torch.float32
        ).eval()
    texts = [t["text"].encode()[:1024] for t in frozen_heldout()[:2]]
    tok = load_tokenizer(model_dir)
    if getattr(tok, "merges", False):
        nats = nbytes = 0.0
        for b in texts:
            ids = torch.tensor([tok.encode_bytes(b)])
            with torch.no_grad():
                lo = ref(ids).logits[0, :-1]
            nats += F.cross_entropy(lo, ids[0, 1:], reduction="sum").item()
            nbytes += len(b) - len(tok.token_bytes()[ids[0, 0]])
        return nats / nbytes
    ids = torch.tensor([list(b) for b in texts])
    with torch.no_grad():
        lo = ref(ids).logits
    return F.cross_entropy(lo[:, :-1].reshape(-1, lo.shape[-1]), ids[:, 1:].reshape(-1)).item()
