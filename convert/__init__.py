"""`dist-glm5 convert ...` (installed as dist_glm5.convert): checkpoint converters."""

from __future__ import annotations

import argparse


def register(p: argparse.ArgumentParser) -> None:
    from . import glm52, glm53, probe, shard, verify

    sub = p.add_subparsers(dest="convert_command", required=True)
    glm53.register(
        sub.add_parser(
            "glm53", help="GLM-5.3 BF16 release -> MXFP4 serving checkpoint (experts encoded)"
        )
    )
    glm52.register(
        sub.add_parser(
            "glm52", help="AMD Quark MXFP4 checkpoint (GLM-5.2) -> serving layout, bytes copied"
        )
    )
    probe.register(
        sub.add_parser(
            "probe", help="which w13 row layout the MoE kernel reads, with negative controls"
        )
    )
    verify.register(
        sub.add_parser(
            "verify", help="check a converted or sharded directory against its manifests and config"
        )
    )
    shard.register(
        sub.add_parser(
            "shard", help="split a checkpoint per pipeline stage and expert-parallel rank"
        )
    )
