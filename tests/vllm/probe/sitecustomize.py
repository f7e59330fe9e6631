"""A read-only probe of vLLM's prefix-cache bookkeeping, for tests/vllm/test_cross_check.py.

On the PYTHONPATH of a vLLM server with ``VLLM_CACHE_EXPORTER_PROBE=<file>`` set, this
wraps two methods of ``vllm.v1.core.kv_cache_manager.KVCacheManager`` once that module is
imported (in the engine-core process, where the scheduler runs) and appends one JSON line
per call to the file; what vLLM computes and returns is untouched:

- ``get_computed_blocks``: every prefix-cache lookup, each attempt to admit a waiting
  request included, with the hits it found (``kind="lookup"``);
- ``record_prefix_cache_stats``: what vLLM adds to its prefix-cache counters
  (``kind="record"``).

A request looked up more than once before its record is one the scheduler retried after
an allocation failure; one looked up with ``preempted`` set is a re-admission. Their hits
are what vLLM would export twice had it counted at lookup (vllm#43736) or counted
re-admissions (vllm#25780). Without the variable this module does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
from typing import Any

TARGET = "vllm.v1.core.kv_cache_manager"
PATH = os.environ.get("VLLM_CACHE_EXPORTER_PROBE")


def _install(module: Any, path: str) -> None:
    manager = module.KVCacheManager
    lock = threading.Lock()
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (the process's life)

    def write(kind: str, request: Any, hits: int) -> None:
        line = json.dumps(
            {
                "kind": kind,
                "request": request.request_id,
                "preempted": request.num_preemptions > 0,
                "tokens": request.num_tokens,
                "hits": hits,
            }
        )
        with lock:
            out.write(line + "\n")

    get_computed_blocks = manager.get_computed_blocks
    record_prefix_cache_stats = manager.record_prefix_cache_stats

    def probed_get_computed_blocks(self: Any, request: Any) -> Any:
        result = get_computed_blocks(self, request)
        if self.prefix_cache_lookup_enabled(request):
            write("lookup", request, result[1])
        return result

    def probed_record_prefix_cache_stats(self: Any, request: Any, num_hits: int) -> None:
        if self.log_stats and self.prefix_cache_lookup_enabled(request):
            write("record", request, num_hits)
        record_prefix_cache_stats(self, request, num_hits)

    manager.get_computed_blocks = probed_get_computed_blocks
    manager.record_prefix_cache_stats = probed_record_prefix_cache_stats


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        assert PATH
        _install(module, PATH)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if PATH:
    sys.meta_path.insert(0, _Finder())
