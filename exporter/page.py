"""The status page at ``/``: what the exporter sees, in plain words first, for the people who
run one card and two agents and no Grafana.

Rendered on the server from ``signals.status`` (the same model the demo tells its story
from, with the same sentences as ``check``), as one self-contained document: inline CSS,
inline SVG sparklines, no script, no font, no image, nothing fetched from anywhere (it works
offline and behind a proxy; the Content-Security-Policy the handler sends forbids anything
else). It reloads itself every ``REFRESH_SECONDS`` with a meta refresh. Every value that
came from outside (caller and model names, URLs, error messages) is escaped.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence

from exporter.signals import advice, prefill
from exporter.signals.status import CallerView, EngineView, Item, RowView, Status

REFRESH_SECONDS = 10
# No fetch of any kind: styles inline, images only as inline SVG (or data: URIs).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SPARK_WIDTH = 240
SPARK_HEIGHT = 28

STYLE = """
:root { color-scheme: light; --ink: #1d232b; --dim: #5b6572; --line: #d9dee5;
  --bad: #b3261e; --bad-bg: #fdecea; --tip: #174ea6; --tip-bg: #e8f0fe; --good: #137333;
  --good-bg: #e6f4ea; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: var(--ink); background: #f6f7f9; }
header, main, footer { max-width: 62rem; margin: 0 auto; padding: 0 1rem; }
header { padding-top: 1rem; }
h1 { font-size: 1.25rem; margin: 0 0 .25rem; }
h2 { font-size: 1.05rem; margin: 1.5rem 0 .5rem; }
h3 { font-size: 1rem; margin: 0 0 .4rem; overflow-wrap: anywhere; }
p { margin: .3rem 0; }
a { color: var(--tip); }
.meta { color: var(--dim); font-size: .85rem; }
.item { border-left: 4px solid var(--tip); background: var(--tip-bg); padding: .5rem .75rem;
  margin: .5rem 0; border-radius: 4px; overflow-wrap: anywhere; }
.item.problem { border-color: var(--bad); background: var(--bad-bg); }
.item.ok { border-color: var(--good); background: var(--good-bg); }
.since { display: block; color: var(--dim); font-size: .85rem; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(18rem, 1fr));
  gap: .75rem; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 6px;
  padding: .75rem; min-width: 0; }
.card.collapsed { border-color: var(--bad); box-shadow: inset 4px 0 0 var(--bad); }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .15rem .75rem; margin: 0; }
dt { color: var(--dim); }
dd { margin: 0; font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
.bar { height: .5rem; background: var(--line); border-radius: 3px; overflow: hidden;
  margin: .15rem 0 .4rem; }
.bar span { display: block; height: 100%; background: var(--tip); }
.bar.over span { background: var(--bad); }
svg.spark { display: block; width: 100%; max-width: 240px; height: auto; }
svg.spark polyline { fill: none; stroke: var(--tip); stroke-width: 1.5; }
svg.spark line { stroke: var(--line); stroke-width: 1; }
svg.spark circle { fill: var(--tip); }
.spark-caption { font-size: .75rem; margin: 0 0 .3rem; }
.warm { color: var(--good); } .cold { color: var(--bad); }
footer { color: var(--dim); font-size: .85rem; padding-bottom: 2rem; }
"""


def escape(value: object) -> str:
    return html.escape(str(value), quote=True)


def render(
    status: Status,
    version: str,
    links: Sequence[str] = ("/metrics", "/-/healthy", "/-/ready"),
    scenario_origin: float | None = None,
) -> str:
    """The page. ``scenario_origin``: the exporter's time at scenario second 0 when it runs in
    the demo, on a clock faster than real time: its times are then shown as scenario time,
    never as a wall-clock UTC time they are not."""
    clock = Clock(scenario_origin)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">',
        '<link rel="icon" href="data:,">',
        f"<title>{_title(status)} · vllm-cache-exporter</title>",
        f"<style>{STYLE}</style></head><body>",
        "<header>",
        f"<h1>vllm-cache-exporter {escape(version)}</h1>",
        f'<p class="meta">Status at {escape(clock.at(status.now))}, refreshed every '
        f"{REFRESH_SECONDS} s. Live counts since the exporter started; ratios over the last "
        f"{escape(advice.duration(status.window_seconds))} and the last "
        f"{escape(advice.duration(status.long_seconds))}, against a baseline over the last "
        f"{escape(advice.duration(status.baseline_seconds))}, as the alerts read them. "
        + " · ".join(f'<a href="{escape(link)}">{escape(link)}</a>' for link in links)
        + "</p></header><main>",
        '<section id="problems"><h2>What is wrong</h2>',
        *_items(status.problems, status.now, clock),
    ]
    if not status.problems:
        parts.append(
            '<p class="item ok" id="no-problem">Nothing wrong that the exporter can see.</p>'
        )
    parts.append("</section>")
    if status.advice:
        parts += [
            '<section id="advice"><h2>Advice</h2>',
            *_items(status.advice, status.now, clock),
            "</section>",
        ]
    parts += ['<section id="engines"><h2>vLLM engines</h2>']
    parts += [_engine(view, status) for view in status.engines] or [
        "<p>No vLLM configured (--vllm.url).</p>"
    ]
    parts += ["</section>", '<section id="callers"><h2>Callers</h2>']
    if status.callers:
        parts.append('<div class="cards">')
        parts += [_caller(view, status) for view in status.callers]
        parts.append("</div>")
        if status.callers_not_shown:
            parts.append(
                f'<p id="callers-not-shown">{status.callers_not_shown} more callers have their '
                "hit ratio and warm share in Prometheus (caller_model:vllm_cache_hit_ratio:*); "
                "this page keeps the history of the --callers.detailed ones and of "
                "--callers.allow.</p>"
            )
    else:
        parts.append(
            "<p>No usage received yet: send it to POST /v1/usage, follow a file "
            "(--usage.file) or put the tap in front of vLLM.</p>"
        )
    parts += [
        "</section></main><footer>",
        "<p>The history behind these figures is one sample every tenth of the short window "
        f"({advice.duration(status.window_seconds / 10)}) for the last "
        f"{escape(advice.duration(status.long_seconds))} per caller and model and per vLLM, "
        "and 288 long-window ratios over the baseline window, in the exporter's memory "
        "(lost on restart): the windows, baseline and collapse condition of the shipped "
        "recording rules and alerts (docs/monitoring.md). Prompt order (is something "
        "variable at the top of the prompt?) is "
        "diagnosed for requests that come through the tap, from fingerprints of their "
        "prompts: no prompt text is kept.</p>",
        "</footer></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _title(status: Status) -> str:
    count = len(status.problems)
    return f"{count} problem(s)" if count else "OK"


class Clock:
    """How the page writes a time: UTC, or in the demo the scenario time since its start."""

    def __init__(self, scenario_origin: float | None = None) -> None:
        self.scenario_origin = scenario_origin

    def at(self, when: float) -> str:
        if self.scenario_origin is None:
            return time.strftime("%H:%M:%S", time.gmtime(when)) + " UTC"
        seconds = int(max(0.0, when - self.scenario_origin))
        return f"scenario time {seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _items(items: Iterable[Item], now: float, clock: Clock) -> list[str]:
    out = []
    for item in items:
        callers = ",".join(item.callers)
        since = ""
        if item.since is not None:
            since = (
                f'<span class="since">since {escape(clock.at(item.since))} '
                f"({escape(advice.duration(now - item.since))} ago)</span>"
            )
        out.append(
            f'<p class="item {escape(item.severity)}" data-kind="{escape(item.kind)}" '
            f'data-callers="{escape(callers)}">{escape(item.sentence)}{since}</p>'
        )
    return out


def _engine(view: EngineView, status: Status) -> str:
    short, long, baseline = _windows(status)
    parts = [
        f'<div class="card" data-target="{escape(view.target)}">',
        f"<h3>{escape(view.target)}</h3>",
        f"<p>{escape(view.state)}" + (f": {escape(view.error)}" if view.error else "") + "</p>",
    ]
    for row in view.rows:
        parts.append(_row(row))
    for fit in view.fits:
        share = min(1.0, fit.fit.ratio) if fit.fit.pool_tokens else 0.0
        over = " over" if fit.fit.overflows else ""
        parts += [
            f"<p><strong>Conversations ({escape(fit.model_name)})</strong>: "
            f"{fit.fit.conversations} active need "
            f"{escape(advice.tokens(fit.fit.demand_tokens))} of "
            f"{escape(advice.tokens(fit.fit.pool_tokens))} tokens</p>",
            f'<div class="bar{over}" title="{escape(fit.sentence)}"><span style="width:'
            f'{share * 100:.1f}%"></span></div>',
        ]
    if view.state == "up":
        parts += [
            "<dl>",
            _pair(f"hit ratio, last {short}", _pct(view.ratio_window)),
            _pair(f"last {long}", _pct(view.ratio_long)),
            _pair("baseline", f"{_pct(view.baseline)} (p90 of the {long} ratio, last {baseline})"),
            _pair(
                "preemptions",
                f"{advice.tokens(view.preemptions)} "
                f"({advice.tokens(view.preemptions_window)} lately)",
            ),
            "</dl>",
            _sparkline(view.sparkline, f"engine hit ratio, last {long}", long),
        ]
    parts.append("</div>")
    return "\n".join(parts)


def _row(row: RowView) -> str:
    caching = {
        True: '<span class="warm">on</span>',
        False: '<span class="cold">OFF</span>',
        None: "unknown",
    }[row.prefix_caching]
    used = ""
    if row.kv_used_tokens is not None and row.pool_tokens:
        used = (
            f"{advice.tokens(row.kv_used_tokens)} of {advice.tokens(row.pool_tokens)} "
            f"tokens ({_pct(row.kv_ratio)})"
        )
    lines = [
        "<dl>",
        _pair(
            "model",
            f"{escape(row.model_name or '-')} (engine {escape(row.engine or '-')})",
            raw=True,
        ),
        _pair("prefix caching", caching, raw=True),
        _pair(
            "KV pool",
            f"{advice.tokens(row.pool_tokens)} tokens, block {row.block_size or '?'}"
            if row.pool_tokens
            else "-",
        ),
        _pair("KV in use", used or "-"),
        _pair(
            "admission budget",
            f"{advice.tokens(row.budget_tokens)} tokens" if row.budget_tokens is not None else "-",
        ),
        _pair("running / waiting", f"{_num(row.running)} / {_num(row.waiting)}"),
        "</dl>",
    ]
    if row.kv_ratio is not None:
        lines.append(
            f'<div class="bar"><span style="width:{min(1.0, row.kv_ratio) * 100:.1f}%">'
            "</span></div>"
        )
    if row.pool_sentence:
        lines.append(f'<p class="meta">{escape(row.pool_sentence)}</p>')
    return "\n".join(lines)


def _windows(status: Status) -> tuple[str, str, str]:
    """The short, long and baseline windows, as people say them."""
    return (
        advice.duration(status.window_seconds),
        advice.duration(status.long_seconds),
        advice.duration(status.baseline_seconds),
    )


def _caller(view: CallerView, status: Status) -> str:
    short, long, baseline = _windows(status)
    collapsed = " collapsed" if view.collapse is not None else ""
    other = sum(view.requests[state] for state in ("short", "unknown", "error"))
    lines = [
        f'<div class="card{collapsed}" data-caller="{escape(view.caller)}">',
        f"<h3>{escape(view.caller)}</h3>",
        f'<p class="meta">{escape(", ".join(view.models))} · first seen '
        f"{escape(advice.duration(status.now - view.first_seen))} ago</p>",
        _sparkline(
            view.sparkline, f"hit ratio of {view.caller} over {short} windows, last {long}", long
        ),
        "<dl>",
        _pair(f"hit ratio, last {short}", _pct(view.ratio_window), "ratio-window"),
        _pair(f"last {long}", _pct(view.ratio_long), "ratio-long"),
        *(
            _pair(
                f"baseline ({pair.model})" if len(view.pairs) > 1 else "baseline",
                f"{_pct(pair.baseline)} (p90 of the {long} ratio, last {baseline})",
                f"baseline-{pair.model}" if len(view.pairs) > 1 else "baseline",
            )
            for pair in view.pairs
        ),
        _pair(f"warm share, last {short}", _pct(view.warm_share_window), "warm-share-window"),
        *(
            _pair(
                f"prefill saved / lost to evictions, last {long}"
                + (f" ({pair.model})" if len(view.pairs) > 1 else ""),
                f"{_prefill(pair.prefill_seconds_saved)} / {_prefill(pair.prefill_seconds_lost)}"
                " (at the model's measured prefill rate)",
                f"prefill-{pair.model}" if len(view.pairs) > 1 else "prefill",
            )
            for pair in view.pairs
        ),
        _pair(
            "warm / partial / cold",
            f'<span class="warm" data-field="warm">'
            f'{view.requests["warm"]:,}</span> / <span data-field="partial">'
            f'{view.requests["partial"]:,}</span> / <span class="cold" data-field="cold">'
            f"{view.requests['cold']:,}</span>",
            raw=True,
        ),
        _pair(
            "other",
            f'<span data-field="other">{other:,}</span> (short '
            f"{view.requests['short']:,}, unknown {view.requests['unknown']:,}, error "
            f"{view.requests['error']:,})",
            raw=True,
        ),
        _pair("cached_tokens reported", _reporting(view)),
        _pair("prompt tokens", f"{view.prompt_tokens:,}", "prompt-tokens"),
        _pair("cached tokens", f"{view.cached_tokens:,}", "cached-tokens"),
        _pair(
            "TTFT warm / cold",
            f"{_secs(view.ttft_warm_p50)} / {_secs(view.ttft_cold_p50)}"
            f" (median since start; {advice.ttft_source_label(view.ttft_source)})",
            "ttft",
        ),
        _pair(
            f"TTFT, last {advice.duration(status.window_seconds)}",
            f"{_secs(view.ttft_window_mean)} (mean of warm and cold turns; "
            f"{advice.ttft_source_label(view.ttft_window_source)})",
            "ttft-window",
        ),
        "</dl></div>",
    ]
    return "\n".join(lines)


def _reporting(view: CallerView) -> str:
    """Whether this caller's usage carries cached_tokens (vLLM's
    --enable-prompt-tokens-details): the prompt tokens of the requests with and without."""
    if view.unreported_prompt_tokens == 0:
        return "yes" if view.prompt_tokens else "-"
    if view.prompt_tokens == 0:
        return "no (--enable-prompt-tokens-details)"
    share = view.unreported_prompt_tokens / (view.unreported_prompt_tokens + view.prompt_tokens)
    return f"partly ({advice.percent(share)} of prompt tokens without)"


def _pair(term: str, value: str, field: str = "", raw: bool = False) -> str:
    shown = value if raw else escape(value)
    attribute = f' data-field="{escape(field)}"' if field else ""
    return f"<dt>{escape(term)}</dt><dd{attribute}>{shown}</dd>"


def _sparkline(points: Sequence[float | None], label: str, long: str) -> str:
    """The points (0 to 1, oldest first, None where there was no traffic) as lines, broken
    where there was none; a lone point is a dot."""
    step = SPARK_WIDTH / max(1, len(points) - 1)
    runs: list[list[tuple[float, float]]] = [[]]
    for index, point in enumerate(points):
        if point is None:
            if runs[-1]:
                runs.append([])
            continue
        runs[-1].append((index * step, (1.0 - max(0.0, min(1.0, point))) * (SPARK_HEIGHT - 2) + 1))
    shapes = []
    for run in runs:
        if len(run) > 1:
            shapes.append(
                '<polyline points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in run) + '"/>'
            )
        elif run:
            shapes.append(f'<circle cx="{run[0][0]:.1f}" cy="{run[0][1]:.1f}" r="1.5"/>')
    return (
        f'<svg class="spark" viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" '
        f'role="img" aria-label="{escape(label)}">'
        f"<title>{escape(label)}</title>"
        f'<line x1="0" y1="{SPARK_HEIGHT - 1}" x2="{SPARK_WIDTH}" y2="{SPARK_HEIGHT - 1}"/>'
        + "".join(shapes)
        + "</svg>"
        f'<p class="meta spark-caption">hit ratio, the last {escape(long)} (now on the '
        "right)</p>"
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else advice.percent(value)


def _prefill(value: float | None) -> str:
    return prefill.minutes(value)


def _secs(value: float | None) -> str:
    return advice.seconds(value)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
