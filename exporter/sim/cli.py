"""``vllm-cache-exporter simulate``: a vLLM stand-in on HOST:PORT, from flags or a scenario.

The flags mirror vLLM's where vLLM has one (``--enable-prefix-caching``,
``--enable-prompt-tokens-details``, ``--block-size``, ``--max-model-len``,
``--served-model-name``); the rest describe the hardware a real engine would measure
(pool size in tokens, prompt and decode rates). ``--scenario`` takes the engine settings from a
scenario file; flags given explicitly win over it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from exporter.sim import scenario as scenarios
from exporter.sim.clock import SimClock
from exporter.sim.engine import EngineConfig, EngineConfigError
from exporter.sim.scenario import ScenarioError
from exporter.sim.server import build_simulator, create_sim_app, start_site

log = logging.getLogger(__name__)

# (flag, EngineConfig field, type, help)
ENGINE_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--served-model-name", "served_model_name", str, "Model name the API serves."),
    ("--kv-pool-tokens", "kv_pool_tokens", int, "Tokens the KV-cache pool holds (vLLM's "
     "\"GPU KV cache size: N tokens\")."),
    ("--block-size", "block_size", int, "KV-cache block size in tokens."),
    ("--granularity", "granularity", int, "Tokens per reusable granule, a multiple of the "
     "block size (default: the block size; on a hybrid model in align mode, the mamba block)."),
    ("--max-model-len", "max_model_len", int, "Longest prompt + completion accepted "
     "(default: the pool, at most 131072)."),
    ("--max-num-seqs", "max_num_seqs", int, "Most requests running at once."),
    ("--prefill-rate", "prefill_rate", float, "Prompt tokens read per second (one prompt at a "
     "time)."),
    ("--decode-rate", "decode_rate", float, "Tokens per second one stream decodes alone."),
    ("--decode-slowdown", "decode_slowdown", float, "Each extra decoding stream slows every "
     "stream by this fraction."),
    ("--prefill-interference", "prefill_interference", float, "Each decoding stream slows "
     "prompt reading by this factor."),
    ("--state-tokens", "state_tokens", int, "Pool tokens one recurrent-state copy of a hybrid "
     "model takes (one per running request, one per resumable prefix)."),
)
BOOL_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--hybrid", "hybrid", "Simulate a hybrid (Mamba / linear-attention) model: prefix caching "
     "off by default, reuse only where a state checkpoint was saved."),
    ("--enable-prefix-caching", "enable_prefix_caching", "Prefix caching (default: on, off "
     "when --hybrid as in vLLM before 0.26)."),
    ("--enable-prompt-tokens-details", "enable_prompt_tokens_details", "Report "
     "prompt_tokens_details.cached_tokens in usage (default: off, as in vLLM)."),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen-address", default="127.0.0.1:8000", metavar="HOST:PORT",
                        help="Where to serve the OpenAI API and /metrics (default: "
                             "%(default)s; port 0 picks a free one).")
    parser.add_argument("--scenario", default="", metavar="NAME",
                        help="Take the engine settings from this scenario ("
                             + ", ".join(scenarios.available()) + ", or a YAML file).")
    parser.add_argument("--speed", type=float, default=1.0, metavar="X",
                        help="Run X times faster than real time (default: 1).")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    engine = parser.add_argument_group("Engine (as vLLM's flags, or the hardware's rates)")
    for flag, dest, kind, help_text in ENGINE_FLAGS:
        metavar = {int: "N", float: "X", str: "NAME"}[kind]
        engine.add_argument(flag, dest=dest, type=kind, default=None, metavar=metavar,
                            help=help_text)
    for flag, dest, help_text in BOOL_FLAGS:
        engine.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                            default=None, help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Scenario settings (if any) under the explicitly given flags."""
    overrides = {dest: getattr(args, dest, None) for _, dest, _, _ in ENGINE_FLAGS}
    overrides.update({dest: getattr(args, dest, None) for _, dest, _ in BOOL_FLAGS})
    if args.scenario:
        return scenarios.load(args.scenario).engine_config(**overrides)
    try:
        return EngineConfig(**{k: v for k, v in overrides.items() if v is not None})
    except EngineConfigError as err:
        raise ScenarioError(str(err)) from None


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


async def serve(config: EngineConfig, host: str, port: int, speed: float) -> int:
    sim = build_simulator(config, SimClock(speed))
    try:
        runner, bound = await start_site(create_sim_app(sim), host, port)
    except OSError as err:
        print(f"simulate: cannot listen on {host}:{port}: {err.strerror}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    log.info("simulated vLLM serving %s on http://%s:%d (pool %d tokens, block %d, granule "
             "%d, prefix caching %s, prompt token details %s, speed x%g)",
             config.served_model_name, host, bound, config.pool_tokens, config.block_size,
             config.granule, "on" if config.prefix_caching else "off",
             "on" if config.enable_prompt_tokens_details else "off", speed)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        host, port = split_address(args.listen_address)
        if args.speed <= 0:
            raise ValueError("--speed must be positive")
        config = engine_config(args)
    except (ValueError, ScenarioError) as err:
        print(f"simulate: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, host, port, args.speed))
    except KeyboardInterrupt:
        return 0
