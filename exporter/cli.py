"""Command line: ``vllm-cache-exporter [run] [flags]`` and the other subcommands.

``run`` is the default, so ``vllm-cache-exporter --vllm.url=...`` starts the exporter as a
node_exporter user would expect. Subcommands live in their own modules and are offered when
their module imports.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from collections.abc import Sequence

from exporter import __version__
from exporter.config import Config, ConfigError, add_flags, build_config

PROG = "vllm-cache-exporter"

# name -> (module, one-line help). Each module has add_arguments(parser) and main(args) -> int.
SUBCOMMANDS = {
    "demo": ("exporter.demo", "One command, no GPU: simulator + exporter + traffic, live view."),
    "simulate": ("exporter.sim.cli", "Run the vLLM simulator (OpenAI API + /metrics)."),
    "drive": ("exporter.sim.driver", "Play a scenario against an OpenAI-compatible server."),
    "generate": ("exporter.monitoring.cli", "Write (or --check) alerts/ and dashboards/."),
    "check": ("exporter.check", "Read a vLLM's /metrics once and say what is wrong, in words."),
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=_Formatter,
        description="Prometheus sidecar for vLLM: prefix-cache hit ratio per caller, warm vs "
                    "cold TTFT, preemptions, KV occupancy in tokens.",
        epilog="Without a command, 'run' is assumed. '%(prog)s COMMAND --help' for details.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="Run the exporter (default).",
                              formatter_class=_Formatter,
                              description="Run the exporter. Every flag can also be set with "
                                          "the environment variable shown, or in "
                                          "--config.file.")
    run.add_argument("--check-config", action="store_true",
                     help="Validate the configuration, print it and exit (0 if valid, 2 if not).")
    add_flags(run)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        sub = commands.add_parser(name, help=help_text, description=help_text,
                                  formatter_class=_Formatter)
        module.add_arguments(sub)
        sub.set_defaults(module=module)
    return parser


def _with_default_command(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    choices = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if not argv:
        return ["run"]
    if argv[0] in choices or argv[0] in ("-h", "--help", "--version"):
        return argv
    return ["run", *argv]


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def config_error(err: ConfigError) -> int:
    print(f"{PROG}: configuration error: {err}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_with_default_command(list(sys.argv[1:] if argv is None else argv),
                                                   parser))
    if args.command != "run":
        return int(args.module.main(args) or 0)
    try:
        config = build_config(args)
    except ConfigError as err:
        return config_error(err)
    if args.check_config:
        print(json.dumps(config.redacted(), indent=2, sort_keys=True))
        return 0
    setup_logging(config.log_level)
    return run(config)


def run(config: Config) -> int:
    from exporter.runtime import serve

    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except ConfigError as err:  # a web config file that broke after build_config read it
        return config_error(err)
    except OSError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    return 0
