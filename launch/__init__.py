"""`launch` subcommands (installed as dist_glm5.launch)."""

from __future__ import annotations

import argparse


def register(p: argparse.ArgumentParser) -> None:
    from . import generate

    sub = p.add_subparsers(dest="launch_command", required=True)
    generate.register(sub.add_parser("generate", help="generate from one prompt and print the result"))
