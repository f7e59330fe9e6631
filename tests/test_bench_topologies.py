"""bench/bench_topologies.py --quick runs its exporters and adds up what they serve: the
table docs/deployment.md quotes is reproducible, and its rows hold together (the same usage
through one exporter or one gateway gives the same per-caller series; spreading callers over
sidecars or shards only adds; each caller is counted once per replica that served it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_topologies  # noqa: E402


def quick_args():  # type: ignore[no-untyped-def]
    return bench_topologies.parse_args(["--quick"])


def test_quick_counts_every_topology(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rows.json"
    assert bench_topologies.main(["--quick", "--json", str(out)]) == 0
    rows = {row["topology"]: row for row in json.loads(out.read_text())}
    one = rows["one exporter for everything"]
    sidecars = rows["a sidecar per replica"]
    gateway = rows["sidecars + one gateway exporter"]
    sharded = rows["sidecars + 3 gateways sticky by session"]
    replicas = bench_topologies.QUICK["replicas"]
    assert [
        one["exporters"],
        sidecars["exporters"],
        gateway["exporters"],
        sharded["exporters"],
    ] == [
        1,
        replicas,
        replicas + 1,
        replicas + 3,
    ]
    assert one["per_caller"] > 0 and one["per_target"] > 0
    assert gateway["per_caller"] == one["per_caller"]  # the same usage, the same exporter
    assert sidecars["per_caller"] > one["per_caller"]  # a caller on several replicas
    assert sharded["per_caller"] >= gateway["per_caller"]
    # Every topology counts each caller on each replica that served it once (a sidecar its
    # own callers): the same per-caller-per-replica series. The replicas answer on one
    # address, told apart by path, as behind a path-routing proxy.
    pairs = {(item.caller, item.replica) for item in bench_topologies.sessions(quick_args())}
    counted = [row["caller_targets"] for row in (one, sidecars, gateway)]
    assert counted == [2 * len(pairs)] * 3
    assert one["largest"] == one["series"]
    printed = capsys.readouterr().out
    assert "| topology | exporters | series |" in printed
