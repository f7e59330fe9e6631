"""Command line: ``vllm-cache-exporter [run] [flags]`` and the other subcommands.

``run`` is the default, so ``vllm-cache-exporter --vllm.url=...`` starts the exporter as a
node_exporter user would expect. Every subcommand's flags come from the one table in
``exporter.config``; each subcommand's module has ``main(settings) -> int`` and receives its
validated settings, never raw argparse values.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from exporter import __version__, logs
from exporter.config import (
    COMMANDS,
    RUN,
    Config,
    ConfigError,
    action_requested,
    add_flags,
    build_config,
    settings,
)
from exporter.redaction import RedactingLogs

PROG = "vllm-cache-exporter"

# name -> (module, one-line help). Each module has main(settings) -> int.
SUBCOMMANDS = {
    "demo": ("exporter.demo", "One command, no GPU: simulator + exporter + traffic, live view."),
    "simulate": ("exporter.sim.cli", "Run the vLLM simulator (OpenAI API + /metrics)."),
    "drive": ("exporter.sim.driver", "Play a scenario against an OpenAI-compatible server."),
    "generate": ("exporter.monitoring.cli", "Write (or --check) alerts/ and dashboards/."),
    "check": ("exporter.check", "Read a vLLM's /metrics once and say what is wrong, in words."),
}
assert set(SUBCOMMANDS) | {RUN} == set(COMMANDS)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=100)


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistyped flag gets the flags it was probably meant to be."""

    command_parsers: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        if "unrecognized arguments:" in message:
            known = [
                option
                for action in self._actions
                for option in action.option_strings
                if option.startswith("--")
            ]
            hints = []
            for word in message.split("unrecognized arguments:", 1)[1].split():
                flag = word.split("=", 1)[0]
                if not flag.startswith("-"):
                    continue
                close = difflib.get_close_matches(flag.replace("_", "-"), known, n=1, cutoff=0.6)
                if not close:  # --vllm-url for --vllm.url: compare without punctuation
                    bare = {option.replace(".", "-"): option for option in known}
                    close = [
                        bare[found]
                        for found in difflib.get_close_matches(
                            flag.replace(".", "-").replace("_", "-"), list(bare), n=1, cutoff=0.8
                        )
                    ]
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def build_parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        formatter_class=_Formatter,
        description="Prometheus sidecar for vLLM: prefix-cache hit ratio per caller, warm vs "
        "cold TTFT, preemptions, KV occupancy in tokens.",
        epilog="Without a command, 'run' is assumed. '%(prog)s COMMAND --help' for details.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = commands.add_parser(
        RUN,
        help="Run the exporter (default).",
        formatter_class=_Formatter,
        description="Run the exporter. Every flag can also be set with "
        "the environment variable shown, or in "
        "--config.file.",
    )
    add_flags(run, RUN)
    parser.command_parsers = {RUN: run}
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, description=help_text, formatter_class=_Formatter
        )
        add_flags(sub, name)
        parser.command_parsers[name] = sub
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line (``run`` assumed); an unknown flag is a usage error of the
    subcommand it was given to, with a suggestion."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(_with_default_command(list(argv)))
    if unknown:
        parser.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _with_default_command(argv: list[str]) -> list[str]:
    if not argv:
        return [RUN]
    if argv[0] in COMMANDS or argv[0] in ("-h", "--help", "--version"):
        return argv
    if not argv[0].startswith("-"):
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(
            f"{PROG}: unknown command '{argv[0]}' (commands: {', '.join(COMMANDS)}){hint}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return [RUN, *argv]


def setup_logging(level: str, log_format: str = "logfmt") -> None:
    logs.setup(level, log_format, (RedactingLogs(),))


def config_error(err: ConfigError, command: str = RUN) -> int:
    where = PROG if command == RUN else f"{PROG} {command}"
    print(f"{where}: configuration error: {err}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.command != RUN:
        try:
            command_settings = settings(args.command, args)
        except ConfigError as err:
            return config_error(err, args.command)
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
        return int(module.main(command_settings) or 0)
    try:
        config = build_config(args)
        check_config = action_requested(RUN, "check-config", args)
    except ConfigError as err:
        return config_error(err)
    if check_config:
        print(json.dumps(config.redacted(), indent=2, sort_keys=True))
        return 0
    setup_logging(config.log_level, config.log_format)
    return run(config)


def run(config: Config) -> int:
    from exporter.runtime import event_loop_name, run_to_completion, serve

    logging.getLogger("exporter.runtime").info("event loop: %s", event_loop_name(config.web_uvloop))
    try:
        run_to_completion(serve(config), config.web_uvloop)
    except KeyboardInterrupt:
        pass
    except ConfigError as err:  # a web config file that broke after build_config read it
        return config_error(err)
    except OSError as err:
        print(f"{PROG}: {err.strerror or err}" if err.errno else f"{PROG}: {err}", file=sys.stderr)
        return 1
    return 0
