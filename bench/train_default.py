"""`dist-glm5 bench train-default`: train the embedded default model on this kind of machine (the
trainer, its recipe and its runs: dist_glm5/train/trainer.py). Resumable: rerunning the command
with the same --out continues from its last saved step.

    dist-glm5 bench train-default --out RUN --seed 1 \\
        --export dist_glm5/checkpoint/default_model/trained
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="train-default", help="run directory (state, log, export)")
    p.add_argument(
        "--steps", type=int, default=None, help="stop here (default: every phase of the recipe)"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument(
        "--export", default=None, help="write the shipped checkpoint here when done (a directory)"
    )
    p.add_argument(
        "--skip-p",
        type=float,
        default=0.0,
        help="share of rows whose position ids jump once (PoSE; 0: the committed recipe)",
    )
    p.add_argument(
        "--indent-weight",
        type=float,
        default=0.0,
        help="extra LM weight on the bytes that decide a line's indentation (0: the committed "
        "recipe)",
    )
    p.add_argument(
        "--line-heads",
        action="store_true",
        help="supervise two heads to read the previous line's indentation and last byte (off: "
        "the committed recipe)",
    )
    p.add_argument(
        "--base-extra",
        type=int,
        default=0,
        help="steps added to the base phase, the later phases moving with it (0: the committed "
        "recipe; with --threads 2 the 3-hour budget holds about 1,800 more)",
    )
    p.add_argument(
        "--unloop",
        type=int,
        default=0,
        help="steps of an unloop phase (unlikelihood on the model's own greedy loops) before the "
        "indexers' and the draft's (0: the committed recipe)",
    )
    p.add_argument(
        "--unloop-at",
        choices=("end", "long", "end-long"),
        default="end",
        help="where the unloop phase goes: before the indexers' phase (end), before the long "
        "sparse phases (long: they train long copying again after it), or at the end on the long "
        "phases' 2,048-byte rows (end-long)",
    )
    p.add_argument(
        "--reindent",
        action="store_true",
        help="train on the code re-indented to 4-space steps, at most one deeper than the line "
        "before and at most 16 (what the column head counts; off: the committed recipe)",
    )
    p.add_argument(
        "--code-share",
        type=float,
        default=0.0,
        help="the plain code's share of the base and long mixes (the copying documents, needles, "
        "copies and repeats, scaled down to make room; the chats keep theirs; 0: the committed "
        "recipe's 0.25)",
    )
    p.add_argument(
        "--simple-code",
        type=float,
        default=0.0,
        help="the share (0 to 1) of the plain code rows that are generated simple modules "
        "(dist_glm5/train/simple_code.py: functions and classes in the common idioms) instead "
        "of stdlib windows (0: the committed recipe)",
    )
    p.add_argument(
        "--relative-paths",
        action="store_true",
        help="the chats' path values as `reports/city.txt`, not `/reports/city.txt` (a leading "
        '"/" began a tenth of all free values, so greedy began every value with it; off: the '
        "committed recipe)",
    )
    p.add_argument(
        "--copy-pieces",
        action="store_true",
        help="with --bpe: the repeat documents' random strings hold the vocabulary's merged word "
        "pieces besides characters, so that merged pieces are copied in training (off: the "
        "committed recipe)",
    )
    p.add_argument(
        "--key-copy",
        action="store_true",
        help="train the induction head's value path to name every key's own id, at every "
        "position (BPE models' heads found a needle's merged pieces but named them first for a "
        "quarter of them; off: the committed recipe)",
    )
    p.add_argument(
        "--needle-decoys",
        type=int,
        default=0,
        metavar="N",
        help="N more needles in every needle document, never asked, whose values begin as an "
        "asked one's and then differ, so that a copied answer follows its own needle past its "
        "first pieces (v6 lost 16K code needles there; 0: the committed recipe)",
    )
    p.add_argument(
        "--unloop-json",
        type=int,
        default=0,
        metavar="N",
        help="N more prompts ending at a JSON reply in every unloop step (under json_object with "
        "--unloop-grammar; v6's JSON replies repeated a key in 5 of 10; 0: the committed recipe)",
    )
    p.add_argument(
        "--unloop-json-fresh",
        action="store_true",
        help="each --unloop-json prompt is a JSON request as a chat's first message, nothing "
        "before it, as a client sends one (off: after 256 bytes of packed chats; v7's replies "
        "to the gate's fresh chats looped in 10 of 10)",
    )
    p.add_argument(
        "--inner-spaces",
        type=int,
        default=0,
        help="cut every run of spaces inside a training line to at most N (with --reindent: "
        "nothing follows 16 spaces with a 17th; 0: unchanged, the committed recipe)",
    )
    p.add_argument(
        "--space-runs",
        type=int,
        default=0,
        help="a vocabulary with one id for each run of 2..N spaces (GLM's tokenizer has such "
        "ids): an indentation is one choice (0: bytes only, the committed recipe)",
    )
    p.add_argument(
        "--space-unit",
        type=int,
        default=0,
        help="a vocabulary with one id for exactly N spaces, taken N at a time (with --reindent "
        "and N = 4: one id per indentation step, runs inside a line bytes when --inner-spaces "
        "< N; 0: bytes only, the committed recipe)",
    )
    p.add_argument(
        "--bpe",
        type=int,
        default=0,
        help="a byte-level BPE vocabulary of N ids learnt on the training code (checkpoint/"
        "bpe.py; about 2.7 bytes of code an id at 2048, so a step sees that much more text), the "
        "chat tags among them (0: bytes only, the committed recipe)",
    )
    p.add_argument(
        "--chat-tags",
        action="store_true",
        help="one id for each tag of the chat format (<tool_call>, </arg_value>, <|user|>, ...; "
        "GLM's tokenizer has such ids): a call's tags are one choice each (off: bytes, the "
        "committed recipe)",
    )
    p.add_argument(
        "--offset-heads",
        type=int,
        choices=(3, 4),
        default=3,
        help="how many heads of layer 0 are told to read the ids 1, 2, 3(, 4) back: with 4 the "
        "induction head matches 4 ids, so needles whose keys end alike are told apart (4 takes "
        "the column head: --space-runs or --space-unit only; 3: the committed recipe)",
    )
    p.add_argument(
        "--kv-lora-rank",
        type=int,
        default=64,
        help="width of MLA's compressed KV, which holds a key's match and the id it copies (64: "
        "the committed recipe)",
    )
    p.add_argument(
        "--match-head",
        action="store_true",
        help="supervise a head of layer 1 to read the id before (which holds layer 0's three "
        "reads), so the induction head can match 4 ids and keep layer 0's free head (off: the "
        "committed recipe)",
    )
    p.add_argument(
        "--copy-direct",
        type=float,
        nargs="?",
        const=1.0,
        default=0.0,
        metavar="SHARE",
        help="the share (0 to 1; 1 when given bare) of the copy loss taken on what the induction "
        "head adds to the logits at the residual's scale, the rest on its output normalised "
        "alone, from the base phase on (0: the committed recipe)",
    )
    p.add_argument(
        "--copy-direct-on",
        choices=["all", "docs"],
        default="all",
        help="the rows --copy-direct's share applies to: all, or the documents' only (not chat "
        "rows: m2, share 1 on all rows, repeated a JSON object's keys; m3, 0.3, lost needles)",
    )
    p.add_argument(
        "--draft-greedy",
        action="store_true",
        help="the draft phase trains the MTP layer on the model's own greedy continuations of "
        "code and chat prompts (what it drafts for when serving), not on the data's rows",
    )
    p.add_argument(
        "--unloop-grammar",
        action="store_true",
        help="the unloop phase continues its chat prompts under the grammar the server would "
        "hold each reply to (a call of the chat's tools, json_object) and also pushes down empty "
        "values and repeated JSON keys: the chats' failures as served (off: the committed recipe)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="export the run's last saved step to --export and stop (gate a run as it goes)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dist_glm5.train.trainer import code_mixes, export_state, train

    logging.basicConfig(level=logging.INFO)
    if args.export_only:
        if not args.export:
            raise SystemExit("--export-only needs --export DIR (where to write the checkpoint)")
        export_state(Path(args.out), Path(args.export), args.seed)
        return 0
    if not 0.0 <= args.copy_direct <= 1.0:
        raise SystemExit(
            f"--copy-direct is a share of the copy loss, 0 to 1; got {args.copy_direct}"
        )
    if args.copy_direct_on != "all" and not args.copy_direct:
        raise SystemExit(
            "--copy-direct-on docs chooses the rows of --copy-direct's share: give both"
        )
    if not 0.0 <= args.simple_code <= 1.0:
        raise SystemExit(
            f"--simple-code is a share of the plain code rows, 0 to 1; got {args.simple_code}"
        )
    if args.copy_pieces and not args.bpe:
        raise SystemExit("--copy-pieces draws from a BPE vocabulary's pieces: give --bpe N")
    if args.needle_decoys < 0 or args.unloop_json < 0:
        raise SystemExit("--needle-decoys and --unloop-json are counts: give 0 or more")
    if args.unloop_json and not args.unloop:
        raise SystemExit("--unloop-json adds prompts to the unloop phase: give --unloop N")
    if args.unloop_json_fresh and not args.unloop_json:
        raise SystemExit(
            "--unloop-json-fresh says how --unloop-json's prompts begin: give --unloop-json N"
        )
    try:
        code_mixes(args.code_share)
    except ValueError as e:
        raise SystemExit(f"--code-share: {e}") from None
    train(
        Path(args.out),
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        save_every=args.save_every,
        export_to=Path(args.export) if args.export else None,
        skip_p=args.skip_p,
        indent_weight=args.indent_weight,
        line_heads=args.line_heads,
        base_extra=args.base_extra,
        unloop_steps=args.unloop,
        unloop_at=args.unloop_at,
        reindent=args.reindent,
        inner_spaces=args.inner_spaces,
        space_runs=args.space_runs,
        chat_tags=args.chat_tags,
        space_unit=args.space_unit,
        bpe=args.bpe,
        offset_heads=args.offset_heads,
        kv_lora_rank=args.kv_lora_rank,
        match_head=args.match_head,
        copy_direct=args.copy_direct,
        copy_direct_on=args.copy_direct_on,
        draft_greedy=args.draft_greedy,
        unloop_grammar=args.unloop_grammar,
        code_share=args.code_share,
        simple_code=args.simple_code,
        relative_paths=args.relative_paths,
        copy_pieces=args.copy_pieces,
        key_copy=args.key_copy,
        needle_decoys=args.needle_decoys,
        unloop_json=args.unloop_json,
        unloop_json_fresh=args.unloop_json_fresh,
    )
    return 0
