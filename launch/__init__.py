"""`launch` subcommands (installed as dist_glm5.launch)."""

from __future__ import annotations

import argparse


def register(p: argparse.ArgumentParser) -> None:
    from . import batch, generate, profile, serve

    sub = p.add_subparsers(dest="launch_command", required=True)
    generate.register(
        sub.add_parser("generate", help="generate from one prompt and print the result")
    )
    serve.register(
        sub.add_parser("single-node", help="plan and serve on one node (OpenAI-compatible API)"),
        1,
        "128k",
    )
    serve.register(
        sub.add_parser("two-node", help="plan and serve as a two-node pipeline"), 2, "637k"
    )
    profile.register(
        sub.add_parser(
            "profile", help="per-stage anatomy of decode steps and prefill chunks, Chrome trace"
        )
    )
    batch.register(
        sub.add_parser(
            "batch", help="a long-context batch job: prompts.jsonl in, results.jsonl out"
        )
    )
