"""``vllm-cache-exporter simulate``: a vLLM stand-in on HOST:PORT, from flags or a scenario.

The ``--sim.*`` flags mirror vLLM's where vLLM has one (``--sim.enable-prefix-caching``,
``--sim.enable-prompt-tokens-details``, ``--sim.block-size``, ``--sim.max-model-len``,
``--sim.served-model-name``); the rest describe the hardware a real engine would measure
(pool size in tokens, prompt and decode rates). ``--scenario`` takes the engine settings from a
scenario file; flags given explicitly win over it. The flags themselves are declared in
``exporter.config``'s one table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys

from exporter import logs
from exporter.sim import scenario as scenarios
from exporter.sim.clock import SimClock
from exporter.sim.engine import EngineConfig, EngineConfigError
from exporter.sim.scenario import ScenarioError
from exporter.sim.server import build_simulator, create_sim_app, start_site

log = logging.getLogger(__name__)

# Settings whose dest is "sim_<EngineConfig field>" configure the simulated engine.
ENGINE_PREFIX = "sim_"
ENGINE_FIELDS = tuple(item.name for item in dataclasses.fields(EngineConfig))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Scenario settings (if any) under the explicitly given ones."""
    overrides = {
        name: getattr(args, ENGINE_PREFIX + name, None)
        for name in ENGINE_FIELDS
        if hasattr(args, ENGINE_PREFIX + name)
    }
    if args.scenario:
        return scenarios.load(args.scenario).engine_config(0, **overrides)  # the first boot
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
    log.info(
        "simulated vLLM serving %s on http://%s:%d (pool %d tokens, block %d, granule "
        "%d, prefix caching %s, prompt token details %s, per-request metrics %s, "
        "speed x%g)",
        config.served_model_name,
        host,
        bound,
        config.kv_pool_tokens,
        config.block_size,
        config.granule,
        "on" if config.prefix_caching else "off",
        "on" if config.enable_prompt_tokens_details else "off",
        "on" if config.enable_per_request_metrics else "off",
        speed,
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def main(args: argparse.Namespace) -> int:
    logs.setup(args.log_level, args.log_format)
    try:
        host, port = split_address(args.sim_listen_address)
        config = engine_config(args)
    except (ValueError, ScenarioError) as err:
        print(f"simulate: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, host, port, args.speed))
    except KeyboardInterrupt:
        return 0
