"""Just enough PromQL reading for the lint tests: which series an expression selects, with
which matchers, and which range windows it uses.

Not a parser: it walks the text, skips strings, label lists (``by (...)``) and range
brackets, and reports every identifier that is neither a keyword, an aggregation nor a
function call. That is what the lints need ("every metric a query names is documented",
"every selector carries the job matcher", "every rate window is $__rate_interval").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
}
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
NUMBER = re.compile(r"(?:\d+\.?\d*(?:e[+-]?\d+)?|\.\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class Selector:
    metric: str  # "" for a bare {…} selector
    matchers: str  # the text between the braces, "" if none


def _skip_string(text: str, i: int) -> int:
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_balanced(text: str, i: int, open_char: str, close_char: str) -> tuple[int, str]:
    """From text[i] == open_char to just past its match; returns (index, inner text)."""
    depth, start = 0, i
    while i < len(text):
        char = text[i]
        if char in "\"'`":
            i = _skip_string(text, i)
            continue
        if char == open_char:
            depth += 1
        elif char == close_char:
            depth -= 1
            if depth == 0:
                return i + 1, text[start + 1 : i]
        i += 1
    raise ValueError(f"unbalanced {open_char!r} in {text!r}")


def _next_non_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def scan(expr: str) -> tuple[list[Selector], list[str]]:
    """(selectors, range windows) of one PromQL expression."""
    selectors: list[Selector] = []
    windows: list[str] = []
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char == "[":
            i, inner = _skip_balanced(expr, i, "[", "]")
            windows.append(inner.strip())
        elif char == "{":
            i, inner = _skip_balanced(expr, i, "{", "}")
            selectors.append(Selector("", inner.strip()))
        elif char.isdigit() or (char == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            match = NUMBER.match(expr, i)
            i = match.end() if match else i + 1
            duration = IDENT.match(expr, i)  # the unit of 5m, 1h30m
            if duration and re.fullmatch(
                r"(ms|s|m|h|d|w|y)([0-9]+(ms|s|m|h|d|w|y))*", duration.group(0)
            ):
                i = duration.end()
        elif IDENT.match(expr, i) and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] == "$")):
            word = IDENT.match(expr, i).group(0)  # type: ignore[union-attr]
            i += len(word)
            after = _next_non_space(expr, i)
            if word in LABEL_LISTS:
                if after < len(expr) and expr[after] == "(":
                    i, _ = _skip_balanced(expr, after, "(", ")")
            elif word == "offset":
                i = _next_non_space(expr, i)
                match = re.compile(r"-?[0-9a-z]+").match(expr, i)
                i = match.end() if match else i
            elif word in KEYWORDS or word in AGGREGATIONS or word.lower() in ("inf", "nan"):
                continue
            elif after < len(expr) and expr[after] == "(":
                continue  # a function call
            elif after < len(expr) and expr[after] == "{":
                i, inner = _skip_balanced(expr, after, "{", "}")
                selectors.append(Selector(word, inner.strip()))
            else:
                selectors.append(Selector(word, ""))
        elif char == "$":  # a Grafana variable outside a string, e.g. in [$__rate_interval]
            match = re.compile(r"\$\{?[a-zA-Z0-9_:]+\}?").match(expr, i)
            i = match.end() if match else i + 1
        else:
            i += 1
    return selectors, windows


def metric_names(expr: str) -> set[str]:
    selectors, _ = scan(expr)
    names = {s.metric for s in selectors if s.metric}
    for s in selectors:
        match = re.search(r'__name__\s*=~?\s*"([^"]+)"', s.matchers)
        if match:
            names.update(match.group(1).split("|"))
    return names


def rate_windows(expr: str) -> list[str]:
    """The range of every rate()/irate()/increase() call."""
    return [
        m.group(2).strip()
        for m in re.finditer(r"\b(rate|irate|increase)\s*\([^\[]*\[([^\]]*)\]", expr)
    ]
