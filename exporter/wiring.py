"""From one Config to the parts that do the work: the signals state and its readers.

The only module that knows both the flags and the readers' and signals' own settings, so
that no reader or signal imports ``config`` (tests/test_architecture.py enforces it). Each
reader is handed the callables it writes through (``record``, ``reject``), never the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from exporter.config import Config
from exporter.engine.fetch import EnginePoller
from exporter.limits import FileDescriptors
from exporter.monitoring.config import MonitoringConfig, load_config
from exporter.signals.foresight import ForesightSettings
from exporter.signals.history import Windows
from exporter.signals.state import SignalsState
from exporter.signals.usage import UsageSettings, UsageState
from exporter.usage import formats
from exporter.usage.ingest import UsageIngest
from exporter.usage.tail import FileFollower
from exporter.usage.tap import TapSettings, create_tap_app
from exporter.values import PromptPrint, UsageEvent

HTTP_READER = "http"
FILE_READER = "file"
TAP_READER = "tap"


def usage_settings(config: Config) -> UsageSettings:
    readers = [HTTP_READER]
    if config.usage_file:
        readers.append(FILE_READER)
    if config.tap_listen_address:
        readers.append(TAP_READER)
    return UsageSettings(
        callers_max=config.callers_max,
        callers_detailed=config.callers_detailed,
        callers_allow=config.callers_allow,
        callers_alias=dict(config.callers_alias),
        granularity=config.signals_granularity,
        warm_tail_granules=config.signals_warm_tail_granules,
        missing_cached_as_zero=config.signals_missing_cached_as_zero,
        readers=tuple(readers),
        max_series=config.callers_max_series,
        targets_max=config.callers_targets_max,
        name_pattern=config.callers_name_pattern,
        model_pattern=config.callers_model_pattern,
        keep_emails=config.callers_keep_emails,
        new_series_hold=config.usage_new_series_hold,
        foresight=foresight_settings(config),
        prompt_order_window=config.signals_prompt_order_window,
        dedup_max_ids=config.usage_dedup_max_ids,
        dedup_window=config.usage_dedup_window,
        windows=windows(load_config(config.monitoring_config_file)),
    )


def windows(monitoring: MonitoringConfig) -> Windows:
    """The alerts' windows, which the status page's history is read over (the same file
    ``generate --config`` made the rules from, given to run as --monitoring.config-file)."""
    return Windows(monitoring.short_seconds, monitoring.long_seconds, monitoring.baseline_seconds)


def foresight_settings(config: Config) -> ForesightSettings:
    return ForesightSettings(
        conversation_idle_seconds=config.signals_conversation_idle,
        max_conversations=config.signals_conversations_max,
        state_tokens=dict(config.signals_state_tokens),
        admission_headroom_tokens=config.signals_admission_headroom,
    )


def signals_state(config: Config, clock: Callable[[], float] = time.time) -> SignalsState:
    return SignalsState(config.engine_targets, usage_settings(config), clock=clock)


def converters(config: Config) -> dict[str, formats.Converter]:
    mapping = formats.load_mapping(config.usage_mapping_file) if config.usage_mapping_file else None
    return formats.build_converters(config.usage_litellm_caller_fields, mapping)


def usage_ingest(config: Config, usage: UsageState) -> UsageIngest:
    return UsageIngest(
        converters(config),
        config.usage_ingest_format,
        config.usage_ingest_token,
        config.usage_ingest_max_body_bytes,
        record_events=lambda rows: usage.record_batch(rows, HTTP_READER),
        reject=lambda reason: usage.reject(HTTP_READER, reason),
        reject_request=usage.reject_request,
        max_concurrent_bodies=config.usage_ingest_max_concurrent_bodies,
        batches=usage.batch_keys,
        clock=usage.now,
    )


def engine_poller(
    config: Config, state: SignalsState, session_factory: Callable[[], aiohttp.ClientSession]
) -> EnginePoller:
    engine = state.engine
    return EnginePoller(
        tuple(engine.targets),
        engine.record_success,
        engine.record_failure,
        session_factory,
        timeout=config.vllm_timeout,
        max_bytes=config.vllm_max_body_bytes,
    )


def file_follower(
    config: Config, usage: UsageState, descriptors: FileDescriptors | None = None
) -> FileFollower:
    """The follower of ``--usage.file``; ``descriptors`` (the process's budget for followed
    files) is asked before each file is opened, and no more files are held open at once
    than ``--usage.file.max-open`` or that budget's share, whichever is less."""
    max_open = config.usage_file_max_open
    if descriptors is not None:
        max_open = max(1, min(max_open, descriptors.share))
    return FileFollower(
        config.usage_file,
        converters(config)[config.usage_file_format],
        record_events=lambda rows: usage.record_events(rows, FILE_READER),
        reject=lambda reason: usage.reject(FILE_READER, reason),
        from_start=config.usage_file_from_start,
        acquire_descriptor=descriptors.acquire if descriptors is not None else None,
        release_descriptor=descriptors.release if descriptors is not None else None,
        max_open=max_open,
    )


def tap_settings(config: Config) -> TapSettings:
    return TapSettings(
        upstream=config.tap_upstream,
        listen_address=config.tap_listen_address,
        caller_header=config.tap_caller_header,
        session_header=config.tap_session_header,
        key_alias=config.tap_key_alias,
        timeout=config.tap_timeout,
        max_request_bytes=config.tap_max_request_bytes,
        max_response_bytes=config.tap_max_response_bytes,
        prompt_order_bytes=config.tap_prompt_order_bytes,
    )


def tap_app(
    config: Config,
    usage: UsageState,
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> web.Application:
    """The tap's app for this configuration, recording into ``usage``."""
    return create_tap_app(
        tap_settings(config),
        record=tap_record(usage),
        reject=tap_reject(usage),
        session=session,
        clock=clock,
        monotonic=monotonic,
        record_prompt=tap_record_prompt(usage),
    )


def tap_record(usage: UsageState) -> Callable[[UsageEvent], object]:
    return lambda event: usage.record(event, TAP_READER)


def tap_reject(usage: UsageState) -> Callable[[str], None]:
    return lambda reason: usage.reject(TAP_READER, reason)


def tap_record_prompt(usage: UsageState) -> Callable[[UsageEvent, PromptPrint], object]:
    return usage.record_prompt
