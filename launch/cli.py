"""`dist-glm5` command line: subcommands launch, bench (and more as they land). `launch X` ==
`dist-glm5 launch X`."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from dist_glm5 import bench, convert, launch

    p = argparse.ArgumentParser(
        prog="dist-glm5", description="Serve GLM-5 family models (CPU reference runtime)."
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    launch.register(sub.add_parser("launch", help="run the model: generate, ..."))
    convert.register(sub.add_parser("convert", help="checkpoint converters: glm53, ..."))
    from dist_glm5.launch import placement

    placement.register(
        sub.add_parser("placement", help="expert routes and expert-to-rank placement")
    )
    bench.register(
        sub.add_parser("bench", help="benchmarks, printed as ratios measured side by side")
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        logging.getLogger("dist-glm5").debug("failed", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2


def launch_main() -> int:
    return main(["launch", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
