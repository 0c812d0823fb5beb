# SPDX-License-Identifier: Apache-2.0
"""Rules: declarative conditions over a job's recent frames that fire `rule` events with their evidence.

A rule file is TOML, a `[[rule]]` table per rule (docs/RULES.md; `--rules default` is jobprobe/node/default_rules.toml):

    [[rule]]
    name = "cpu_throttled"
    summary = "the job's cgroup CPU limit stops it"
    when = "share(cgroup.cpu_throttled_ns) > 0.10"     # an expression over the last `window` seconds
    clear = "share(cgroup.cpu_throttled_ns) < 0.05"    # optional: by default, `when` no longer holds
    window = 10        # s of frames each evaluation reads
    hold = 10          # s `when` must keep holding before the rule fires
    cooldown = 60      # s after an end before it may fire again
    action = "event"   # what firing does: an event frame ("trace": also a deep-trace window, when available)

Expressions: numbers, `+ - * /`, comparisons, `and` / `or` / `not`, parentheses, and references to frame fields
as `probe.field` (a device list's field as `probe.list.field`, e.g. `gpu.gpus.util_gpu_pct`, averaged over the
job's devices). A bare reference is the field over the window by its declared kind: a counter's rate per second
(Σ value / Σ dt), a gauge's mean. Functions: `share(x)` a time counter in ns as a share of wall time (rate / 1e9),
`rate(x)`, `mean(x)`, `max(x)`, `min(x)`, `last(x)`, `p50(h)` / `p99(h)` of a log2 histogram (its unit),
`any_bits(x, MASK)` the share of frames in which any device's bitmask field has a bit of MASK set. A reference to a
field the job's frames do not carry (its probe off or unavailable) makes the rule not evaluable: it does not fire,
and says so once in the agent's log.

Evaluated after every frame of the job (cheap: a few sums over at most a window of frames per referenced field).
"""
from __future__ import annotations

import ast
import logging
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobprobe.core import tomlfile
from jobprobe.core.errors import BadInput
from jobprobe.core.numbers import is_amount, is_number

log = logging.getLogger("jobprobe.node.rules")

DEFAULT = Path(__file__).with_name("default_rules.toml")
FUNCS = {"share", "rate", "mean", "max", "min", "last", "p50", "p99", "any_bits"}
KEYS = {"name", "summary", "when", "clear", "window", "hold", "cooldown", "action", "clear_after", "trace_s"}
ACTIONS = {"event", "trace"}


class NotEvaluable(Exception):
    """A field the rule reads is not in the job's frames."""


# ---- expressions ---------------------------------------------------------------------------------------------
_ALLOWED = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd, ast.BinOp,
            ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Compare, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq,
            ast.Constant, ast.Attribute, ast.Name, ast.Load, ast.Call)


def ref_of(node: ast.AST) -> str | None:
    """`a.b` or `a.b.c` as a dotted name; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and 1 <= len(parts) <= 2:
        return ".".join([node.id, *reversed(parts)])
    return None


def compile_expr(text: str) -> ast.Expression:
    """Parse and check an expression; ValueError saying what is wrong."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an expression: {err.msg} in {text!r}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ValueError(f"{type(node).__name__} is not allowed in {text!r}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers may be constants in {text!r}")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCS:
                raise ValueError(f"unknown function in {text!r}: known are {', '.join(sorted(FUNCS))}")
            if node.keywords or not node.args or ref_of(node.args[0]) is None:
                raise ValueError(f"{node.func.id}() takes a field (probe.field) in {text!r}")
            want = 2 if node.func.id == "any_bits" else 1
            if len(node.args) != want:
                raise ValueError(f"{node.func.id}() takes {want} argument(s) in {text!r}")
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.value, ast.Attribute):
            roots.add(id(node.value))
        if isinstance(node, ast.Call):
            roots.add(id(node.func))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in roots:
            raise ValueError(f"{node.id!r} alone is not a field (probe.field) in {text!r}")
    for node in ast.walk(tree):     # every attribute chain is probe.field or probe.list.field
        if isinstance(node, ast.Attribute) and not any(isinstance(p, ast.Attribute) and p.value is node
                                                        for p in ast.walk(tree)) and ref_of(node) is None:
            raise ValueError(f"{ast.unparse(node)!r} is not probe.field or probe.list.field in {text!r}")
    return tree


# ---- a window of frames -------------------------------------------------------------------------------------
class Window:
    def __init__(self, schema: dict[str, dict[str, dict[str, str]]]):
        self.schema = schema
        self.frames: deque[tuple[float, float, dict]] = deque()

    def add(self, t: float, dt: float, probes: dict) -> None:
        self.frames.append((t, dt, probes))

    def trim(self, keep_s: float) -> None:
        if self.frames:
            newest = self.frames[-1][0]
            while self.frames and self.frames[0][0] <= newest - keep_s:
                self.frames.popleft()

    def span(self, seconds: float) -> list[tuple[float, float, dict]]:
        if not self.frames:
            return []
        newest = self.frames[-1][0]
        return [f for f in self.frames if f[0] > newest - seconds]

    def kind(self, ref: str) -> str:
        parts = ref.split(".")
        decl = self.schema.get(parts[0], {})
        key = parts[1] if len(parts) == 2 else f"{parts[1]}[].{parts[2]}"
        if key not in decl:
            raise NotEvaluable(f"{ref} is not a field of the job's probes")
        return decl[key].get("kind", "gauge")

    @staticmethod
    def value(probes: dict, ref: str) -> Any:
        parts = ref.split(".")
        sec = probes.get(parts[0])
        if not isinstance(sec, dict) or parts[1] not in sec:
            return None
        v = sec[parts[1]]
        if len(parts) == 3:
            items = [i.get(parts[2]) for i in v if isinstance(i, dict)] if isinstance(v, list) else []
            items = [x for x in items if is_number(x)]
            return items or None
        return v


def _series(frames, ref: str) -> list[tuple[float, Any]]:
    out = [(dt, Window.value(p, ref)) for _, dt, p in frames]
    return [(dt, v) for dt, v in out if v is not None]


def _scalar(v: Any, counter: bool) -> float | None:
    if isinstance(v, list):                       # a device list: summed (counters) or averaged (gauges)
        return (sum(v) if counter else sum(v) / len(v)) if v else None
    return float(v) if is_number(v) else None


def evaluate(tree: ast.Expression, win: Window, seconds: float, used: dict[str, float]) -> Any:
    frames = win.span(seconds)
    wall = sum(dt for _, dt, _ in frames) or 1e-9

    def field(fn: str, ref: str, extra: list[Any]) -> float:
        kind = win.kind(ref)
        ser = _series(frames, ref)
        if not ser:
            raise NotEvaluable(f"{ref} is absent from the job's frames")
        counter = kind == "counter"
        if fn in ("p50", "p99"):
            from jobprobe.core.counters import log2_percentile
            hist: list[int] = []
            for _, h in ser:
                if isinstance(h, list):
                    hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
            return float(log2_percentile(hist, 0.5 if fn == "p50" else 0.99) or 0.0)
        if fn == "any_bits":
            mask = int(extra[0])
            hits = sum(1 for _, v in ser if any(int(x) & mask for x in (v if isinstance(v, list) else [v])))
            return hits / len(ser)
        vals = [(dt, s) for dt, v in ser if (s := _scalar(v, counter)) is not None]
        if not vals:
            raise NotEvaluable(f"{ref} holds no numbers")
        if fn in ("rate", "share") or (fn == "" and counter):
            r = sum(v for _, v in vals) / wall
            return r / 1e9 if fn == "share" else r
        if fn in ("mean", ""):
            return sum(v for _, v in vals) / len(vals)
        if fn == "max":
            return max(v for _, v in vals)
        if fn == "min":
            return min(v for _, v in vals)
        return vals[-1][1]                         # last

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Call):
            ref = ref_of(node.args[0])
            extra = [ev(a) for a in node.args[1:]]
            v = field(node.func.id, ref, extra)
            used[f"{node.func.id}({ref}{''.join(', ' + str(e) for e in extra)})"] = round(v, 6)
            return v
        if isinstance(node, ast.Attribute):
            ref = ref_of(node)
            v = field("", ref, [])
            used[ref] = round(v, 6)
            return v
        if isinstance(node, ast.BoolOp):
            vals = [ev(v) for v in node.values]     # every term evaluated: all of them are evidence
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return (not v) if isinstance(node.op, ast.Not) else (-v if isinstance(node.op, ast.USub) else v)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div):
                return a / b if b else math.inf if a > 0 else 0.0
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                ok = {ast.Lt: left < right, ast.LtE: left <= right, ast.Gt: left > right, ast.GtE: left >= right,
                      ast.Eq: left == right, ast.NotEq: left != right}[type(op)]
                if not ok:
                    return False
                left = right
            return True
        raise ValueError(f"cannot evaluate {type(node).__name__}")
    return ev(tree)


# ---- rules ------------------------------------------------------------------------------------------------
@dataclass
class Rule:
    name: str
    when: str
    summary: str = ""
    clear: str | None = None
    window: float = 10.0
    hold: float = 10.0
    cooldown: float = 60.0
    clear_after: float = 5.0
    action: str = "event"
    trace_s: float = 25.0         # a `trace` action's window
    tree: Any = None
    clear_tree: Any = None


def _line_of(text: str, name: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if re.match(rf'\s*name\s*=\s*["\']{re.escape(name)}["\']', line):
            return i
    return 0


def load(spec: str) -> list[Rule]:
    """Rules from a file, or "default" (the shipped set). BadInput naming the file, line and rule on an error."""
    path = DEFAULT if spec == "default" else Path(spec)
    text, data = tomlfile.read(path, "rules")
    if set(data) - {"rule", "efficiency"} or not isinstance(data.get("rule"), list):
        raise BadInput(f"rules {path}: expected [[rule]] tables (and an [efficiency] table) only")
    from jobprobe.core.efficiency import thresholds
    thresholds(data.get("efficiency"), f"rules {path}")     # the summary's: checked here too, one clear line
    out, seen = [], set()
    for i, item in enumerate(data["rule"]):
        name = str(item.get("name") or f"#{i + 1}")
        where = f"rules {path} line {_line_of(text, name)}: rule {name!r}"
        unknown = set(item) - KEYS
        if unknown:
            raise BadInput(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(KEYS))})")
        if "name" not in item or "when" not in item:
            raise BadInput(f"{where}: needs name and when")
        if name in seen:
            raise BadInput(f"{where}: a second rule of that name")
        seen.add(name)
        try:
            r = Rule(**{k: item[k] for k in item})
            for k in ("name", "when", "summary", "action", "clear"):
                if not isinstance(getattr(r, k), str) and (k != "clear" or r.clear is not None):
                    raise ValueError(f"{k} must be a string")
            r.tree = compile_expr(r.when)
            r.clear_tree = compile_expr(r.clear) if r.clear else None
            if r.action not in ACTIONS:
                raise ValueError(f"action must be one of {', '.join(sorted(ACTIONS))}")
            for k in ("window", "hold", "cooldown", "clear_after", "trace_s"):
                v = getattr(r, k)
                if not is_amount(v):
                    raise ValueError(f"{k} must be a number of seconds ≥ 0")
            if r.window <= 0:
                raise ValueError("window must be > 0")
        except (TypeError, ValueError) as err:
            raise BadInput(f"{where}: {err}") from None
        out.append(r)
    return out


@dataclass
class State:
    since: float | None = None          # `when` true since (frame time)
    quiet_since: float | None = None    # while firing: `when` false / clear true since
    fired_at: float | None = None
    ended_at: float = -math.inf
    said: str | None = None             # why it cannot be evaluated, said once
    evidence: dict = field(default_factory=dict)


class RuleSet:
    """One job's rules over its frames. feed() takes each sample frame; returns the events to emit."""

    def __init__(self, rules: list[Rule], schema: dict[str, dict[str, dict[str, str]]], job: str = ""):
        self.rules, self.job = rules, job
        self.win = Window(schema)
        self.keep = max((r.window for r in rules), default=10.0)
        self.state = {r.name: State() for r in rules}
        self.cost_s = 0.0
        self.evaluations = 0

    def feed(self, frame: dict) -> list[dict]:
        if frame.get("kind") != "sample" or not isinstance(frame.get("probes"), dict):
            return []
        t0 = time.perf_counter()
        t = float(frame["t"])
        self.win.add(t, float(frame.get("dt") or 0.0), frame["probes"])
        self.win.trim(self.keep)
        covered = sum(dt for _, dt, _ in self.win.frames)
        out = []
        for r in self.rules:
            st = self.state[r.name]
            if covered < 0.8 * r.window and st.fired_at is None:
                continue                        # not a whole window yet
            used: dict[str, float] = {}
            try:
                holds = bool(evaluate(r.tree, self.win, r.window, used))
                cleared = (bool(evaluate(r.clear_tree, self.win, r.window, {})) if r.clear_tree is not None
                           else not holds)
                st.said = None
            except NotEvaluable as err:
                if st.said != str(err):
                    log.info("job %s: rule %s not evaluable: %s", self.job, r.name, err)
                    st.said = str(err)
                holds, cleared = False, True
            self.evaluations += 1
            if st.fired_at is None:
                if holds and t - st.ended_at >= r.cooldown:
                    st.since = t if st.since is None else st.since
                    if t - st.since >= r.hold:
                        st.fired_at, st.quiet_since, st.evidence = t, None, used
                        out.append({"t": t, "event": "rule", "rule": r.name, "summary": r.summary,
                                    "action": r.action, "when": r.when, "evidence": used, "window_s": r.window,
                                    "since": st.since, **({"trace_s": r.trace_s} if r.action == "trace" else {})})
                else:
                    st.since = None
            else:
                if cleared:
                    st.quiet_since = t if st.quiet_since is None else st.quiet_since
                    if t - st.quiet_since >= r.clear_after:
                        out.append({"t": t, "event": "rule_end", "rule": r.name,
                                    "duration_s": round(st.quiet_since - (st.since or st.fired_at), 3),
                                    "evidence": used})
                        st.fired_at, st.since, st.quiet_since, st.ended_at = None, None, None, t
                else:
                    st.quiet_since = None
        self.cost_s += time.perf_counter() - t0
        return out
