"""The tap: a transparent reverse proxy in front of vLLM that records one event per call."""

from exporter.usage.tap.proxy import TapSettings, create_tap_app, run_tap

__all__ = ["TapSettings", "create_tap_app", "run_tap"]
