"""``vllm-cache-exporter drive``: play a scenario's traffic against an OpenAI-compatible server.

Each agent of the scenario is a caller: conversations that grow turn by turn (the agent
resends its whole history, as agents do), or fan-outs of concurrent one-shot requests. Every
request carries the caller's identity (``user`` and ``X-Caller``), and its usage and measured
TTFT are reported to the exporter's ``POST /v1/usage`` as a proxy would. The texts are made of
one-token words unique to each conversation and loop, so what is cached is decided by the
scenario's structure alone. Works against the simulator or a real vLLM. While it runs it
logs its progress at info level every ``--drive.progress-interval`` seconds (``Progress``):
requests sent, reported, failed, and the scenario time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from exporter import logs
from exporter.sim import scenario as scenarios
from exporter.sim.client import Client, Completion, HttpClient
from exporter.sim.clock import SimClock
from exporter.sim.report import HttpReporter, LineReporter, Reporter, usage_event
from exporter.sim.scenario import FANOUT, SHARED_FIRST, AgentSpec, Scenario, ScenarioError
from exporter.sim.tokenizer import base36, chat_overhead, words

log = logging.getLogger(__name__)

_TAG_SPACE = 36**4
# Real seconds to wait after a request got no answer, so a down server is not hammered.
TRANSPORT_BACKOFF_SECONDS = 1.0


@dataclass
class DriverStats:
    requests: int = 0
    errors: int = 0
    unreported: int = 0  # successes whose response carried no usage
    reported: int = 0  # usage events handed to the reporter
    iterations: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class Driver:
    """Plays a scenario through a client; one iteration, or again and again with ``loop``."""

    def __init__(
        self,
        scenario: Scenario,
        client: Client,
        reporter: Reporter,
        clock: SimClock,
        model: str,
        loop: bool = False,
        seed: int = 0,
        wall_clock: Callable[[], float] = time.time,
        between: Callable[[int], Awaitable[None]] | None = None,
        backend: str | None = None,
    ) -> None:
        self.scenario = scenario
        self.client = client
        self.reporter = reporter
        self.clock = clock
        self.model = model
        self.loop = loop
        self.wall_clock = wall_clock
        # Awaited after each iteration that another follows (with the number of the next):
        # the demo restarts its simulated vLLM there, so a loop is a restart as seen outside.
        self.between = between
        # The vLLM the requests go to, as the usage events name it (their ``backend``).
        self.backend = backend
        self.stats = DriverStats()
        self._tags = itertools.count(seed % _TAG_SPACE)

    def _tag(self) -> str:
        """A short prefix no other text of this run uses (so texts share nothing by chance)."""
        return base36(next(self._tags) % _TAG_SPACE)

    async def run(self, iterations: int | None = None) -> DriverStats:
        """Play the scenario ``iterations`` times (default: once, or for ever with loop)."""
        if iterations is None:
            iterations = 0 if self.loop else 1
        iteration = 0
        while not iterations or iteration < iterations:
            await asyncio.gather(*(self._agent(agent, iteration) for agent in self.scenario.agents))
            iteration += 1
            if self.between is not None and (not iterations or iteration < iterations):
                await self.between(iteration)
            self.stats.iterations += 1
        return self.stats

    async def _agent(self, agent: AgentSpec, iteration: int) -> None:
        await self.clock.sleep(agent.start)
        if agent.kind == FANOUT:
            await self._fanout(agent, iteration)
        else:
            await asyncio.gather(
                *(self._conversation(agent, iteration, index) for index in range(agent.count))
            )

    async def _send(self, kind: str, body: dict[str, Any], caller: str, session: str) -> Completion:
        completion = await self.client.send(kind, body, caller, session)
        stats = self.stats
        stats.requests += 1
        key = str(completion.status)
        stats.by_status[key] = stats.by_status.get(key, 0) + 1
        if not completion.ok:
            stats.errors += 1
            log.warning("%s: %s %s", caller, completion.status, completion.error or "")
        event = usage_event(
            caller, session, completion, self.wall_clock(), body.get("max_tokens"), self.backend
        )
        if event is None:
            stats.unreported += 1
        else:
            stats.reported += 1
            self.reporter.report(event)
        if isinstance(completion.status, str):  # no answer at all: the server is down
            await self.clock.sleep(self.clock.speed * TRANSPORT_BACKOFF_SECONDS)
        return completion

    def _body(self, agent: AgentSpec, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
        declared = agent.declared_max_tokens or agent.output_tokens
        body: dict[str, Any] = {"model": self.model, "max_tokens": declared, "stream": agent.stream}
        if declared > agent.output_tokens:  # the answer ends before what was declared
            body["vllm_xargs"] = {"answer_tokens": agent.output_tokens}
        if agent.stream:
            body["stream_options"] = {"include_usage": True}
        if agent.endpoint == "chat":
            body["messages"] = messages
            return "chat", body
        body["prompt"] = "\n".join(message["content"] for message in messages)
        return "completion", body

    async def _conversation(self, agent: AgentSpec, iteration: int, index: int) -> None:
        session = f"{agent.caller}/{iteration}" + (f"/{index}" if agent.count > 1 else "")
        context = max(0, agent.context_tokens - chat_overhead(2))
        messages = [{"role": "system", "content": words(context, self._tag())}]
        user_tag = self._tag()
        for turn in range(agent.turns):
            messages.append(
                {
                    "role": "user",
                    "content": words(agent.input_tokens, user_tag, start=turn * agent.input_tokens),
                }
            )
            kind, body = self._body(agent, messages)
            completion = await self._send(kind, body, agent.caller, session)
            if completion.ok:
                messages.append({"role": "assistant", "content": completion.text})
            else:
                messages.pop()
            if turn + 1 < agent.turns:
                await self.clock.sleep(agent.think_seconds)

    async def _fanout(self, agent: AgentSpec, iteration: int) -> None:
        for round_index in range(agent.rounds):
            started = self.clock.now()
            shared = words(agent.shared_tokens, self._tag())
            requests = []
            for member in range(agent.width):
                task = words(agent.task_tokens, self._tag())
                text = f"{shared} {task}" if agent.order == SHARED_FIRST else f"{task} {shared}"
                kind, body = self._body(agent, [{"role": "user", "content": text}])
                session = f"{agent.caller}/{iteration}/{round_index}/{member}"
                requests.append(self._send(kind, body, agent.caller, session))
            await asyncio.gather(*requests)
            if round_index + 1 < agent.rounds:
                await self.clock.sleep(agent.every_seconds - (self.clock.now() - started))


class Progress:
    """Says how a drive is going, at info level, every ``interval`` seconds of the event
    loop's clock (wall seconds; virtual ones in a virtual run): one line with the requests
    sent, their usage events reported, the requests failed, and the scenario time. Through
    exporter/logs.py, so each figure is a field of its own in logfmt and JSON."""

    def __init__(self, driver: Driver, interval: float) -> None:
        self.driver = driver
        self.interval = interval

    def fields(self) -> dict[str, Any]:
        stats = self.driver.stats
        out: dict[str, Any] = {
            "requests": stats.requests,
            "reported": stats.reported,
            "failed": stats.errors,
            "without_usage": stats.unreported,
            "scenario_seconds": round(self.driver.clock.now(), 1),
            "iterations": stats.iterations,
        }
        reporter = self.driver.reporter
        if isinstance(reporter, HttpReporter):  # what reached the exporter so far
            out.update(
                delivered=reporter.sent, pending=len(reporter.pending), dropped=reporter.dropped
            )
        return out

    def log(self) -> None:
        fields = self.fields()
        seconds = int(fields["scenario_seconds"])
        delivery = (
            f" ({fields['delivered']} delivered to the exporter, {fields['pending']} "
            f"pending, {fields['dropped']} dropped)"
            if "delivered" in fields
            else ""
        )
        log.info(
            "%d request(s) sent, %d reported%s, %d failed, scenario time %d:%02d, "
            "%d full iteration(s)",
            fields["requests"],
            fields["reported"],
            delivery,
            fields["failed"],
            seconds // 60,
            seconds % 60,
            fields["iterations"],
            extra=fields,
        )

    async def run(self) -> None:
        """Log every ``interval`` seconds until cancelled (0: never)."""
        if self.interval <= 0:
            return
        while True:
            await asyncio.sleep(self.interval)  # a period, not a wait for something
            self.log()


# ---- command line ----------------------------------------------------------------------


def all_failed(stats: DriverStats, base_url: str) -> str:
    """Why the run failed as a whole, when not one request got an answer it could use; else
    "". A run with some failures is a run (servers refuse now and then)."""
    if not stats.requests or stats.errors < stats.requests:
        return ""
    statuses = ", ".join(f"{status} x{count}" for status, count in sorted(stats.by_status.items()))
    unanswered = all(not status.isdigit() for status in stats.by_status)
    where = _without_credentials(base_url)
    why = (
        f"no answer from {where}: is the server up, and is --drive.base-url its address?"
        if unanswered
        else f"{where} refused them: is --drive.base-url an OpenAI-compatible server (a vLLM, "
        "the simulator), and --drive.model a model it serves?"
    )
    return f"all {stats.requests} request(s) failed ({statuses}): {why}"


def _without_credentials(url: str) -> str:
    """The URL without any user:password, shown as ``***@`` (the simulator imports nothing of
    the exporter, so not its redaction module; this only needs to drop them)."""
    return without_userinfo(url, mask="***@")


def without_userinfo(url: str, mask: str = "") -> str:
    """The URL as a usage event's backend: no user:password (the label the exporter makes of
    it is the URL's origin; a credential has no place in an event either). ``mask`` stands
    where they were."""
    parts = urlsplit(url.strip())
    if "@" not in parts.netloc:
        return url.strip()
    return urlunsplit(parts._replace(netloc=mask + parts.netloc.rpartition("@")[2]))


async def drive(args: argparse.Namespace, scenario: Scenario) -> int:
    client = HttpClient(args.drive_base_url)
    reporter: Reporter = (
        HttpReporter(args.drive_exporter_url, args.usage_ingest_token)
        if args.drive_exporter_url
        else LineReporter()
    )
    try:
        model = args.drive_model
        if not model:
            try:
                listed = await client.models()
            except Exception as err:  # the server may not be up yet; the scenario names one
                log.warning("cannot list models at %s (%s)", args.drive_base_url, err)
                listed = []
            model = listed[0] if listed else scenario.engine.get("served_model_name", "sim-llama")
        seed = args.seed if args.seed is not None else int(time.time())
        driver = Driver(
            scenario,
            client,
            reporter,
            SimClock(args.speed),
            model,
            loop=args.loop,
            seed=seed,
            backend=without_userinfo(args.drive_base_url),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        run = asyncio.ensure_future(driver.run())
        stopper = asyncio.ensure_future(stop.wait())
        progress = asyncio.ensure_future(Progress(driver, args.drive_progress_interval).run())
        await asyncio.wait(
            (run, stopper), timeout=args.duration or None, return_when=asyncio.FIRST_COMPLETED
        )
        for task in (run, stopper, progress):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        stats = driver.stats
        log.info(
            "drove %d request(s) (%d failed) over %d full iteration(s)",
            stats.requests,
            stats.errors,
            stats.iterations,
        )
        failure = all_failed(stats, args.drive_base_url)
        if failure:
            print(f"drive: {failure}", file=sys.stderr)
            return 1
        return 0
    finally:
        await client.close()
        await reporter.close()


def main(args: argparse.Namespace) -> int:
    logs.setup(args.log_level, args.log_format)
    try:
        scenario = scenarios.load(args.scenario)
    except ScenarioError as err:
        print(f"drive: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(drive(args, scenario))
    except KeyboardInterrupt:
        return 0
