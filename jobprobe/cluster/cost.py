# SPDX-License-Identifier: Apache-2.0
"""What a job cost: node-hours, GPU-hours, energy and money per job, per node and per hour of its run, from the
controller's store and a price file; and what was wasted — GPU-hours idle or waiting, node-hours lost to
revocations.

The price file (TOML):

    currency = "USD"
    electricity_per_kwh = 0.12     # optional: the energy measured (CPU packages + DRAM + GPUs) priced on its own
    idle_gpu_util_pct = 10         # a GPU-interval under this utilization is idle (default 10)

    [[node]]                       # first match wins; a node no entry matches has no price (said so)
    name = "h100-spot"
    hostname = "gpu-*"             # glob on the node's name in frames
    gpu = "NVIDIA H100*"           # glob on the name NVML gives the node's GPUs
    label = "market=spot"          # a scheduler label the job's frames carry
    market = "spot"                # spot | on_demand (default on_demand)
    per_hour = 35.0                # the node's price per hour (required)
    gpus = 8                       # GPUs in the node: a GPU-hour costs per_hour / gpus (default: as seen)

Per node of the job: node-hours (the samples' intervals), GPU-hours (× the job's GPUs in each), idle GPU-hours
(utilization under the bound), waiting GPU-hours (while one of the rules gpu_idle_cpu_busy or input_bound held on
that node), energy (energy.cpu_energy_j + dram_energy_j, gpus[].job_energy_mj), the node's money (node-hours ×
per_hour) and, with an electricity price, the energy's. A node that the controller lost (`node_lost`) and whose job
then went on in a new run (a restart: samples of another run after the loss) was revoked: its node-hours in that
run are lost work, in `revoked_node_hours` and their money.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from jobprobe.core import tomlfile
from jobprobe.core.errors import BadInput
from jobprobe.core.numbers import is_amount, is_int

WAITING_RULES = ("gpu_idle_cpu_busy", "input_bound")
NODE_KEYS = {"name", "hostname", "gpu", "label", "market", "per_hour", "gpus"}
TOP_KEYS = {"currency", "electricity_per_kwh", "idle_gpu_util_pct", "node"}


@dataclass
class NodePrice:
    name: str
    per_hour: float
    market: str = "on_demand"
    hostname: str | None = None
    gpu: str | None = None
    label: str | None = None
    gpus: int | None = None


@dataclass
class Prices:
    nodes: list[NodePrice] = field(default_factory=list)
    currency: str = "USD"
    electricity_per_kwh: float | None = None
    idle_gpu_util_pct: float = 10.0

    def match(self, node: str, gpu_names: set[str], labels: dict[str, str]) -> NodePrice | None:
        for p in self.nodes:
            if p.hostname and not fnmatch.fnmatch(node, p.hostname):
                continue
            if p.gpu and not any(fnmatch.fnmatch(g, p.gpu) for g in gpu_names):
                continue
            if p.label:
                k, _, v = p.label.partition("=")
                if labels.get(k) != v:
                    continue
            return p
        return None


def _line(text: str, nth: int, key: str | None) -> int:
    """The line of the nth [[node]] table (0-based), or of `key` inside it."""
    starts = [i for i, ln in enumerate(text.splitlines(), 1) if re.match(r"\s*\[\[\s*node\s*\]\]", ln)]
    if nth >= len(starts):
        return 1
    start = starts[nth]
    end = starts[nth + 1] if nth + 1 < len(starts) else len(text.splitlines()) + 1
    if key:
        for i, ln in enumerate(text.splitlines()[start:end - 1], start + 1):
            if re.match(rf"\s*{re.escape(key)}\s*=", ln):
                return i
    return start


def load(path: str) -> Prices:
    """A price file; BadInput naming the file and line on an error."""
    text, data = tomlfile.read(path, "prices")
    bad = set(data) - TOP_KEYS
    if bad:
        raise BadInput(f"prices {path}: unknown key {sorted(bad)[0]!r} (known: {', '.join(sorted(TOP_KEYS))})")
    if not isinstance(data.get("currency", ""), str):
        raise BadInput(f"prices {path}: currency must be a string, got {repr(data['currency'])[:40]}")
    for key, most in (("idle_gpu_util_pct", 100), ("electricity_per_kwh", None)):
        if key in data and not is_amount(data[key], most):
            raise BadInput(f"prices {path}: {key} must be a number from 0"
                           f"{f' to {most}' if most else ''}, got {repr(data[key])[:40]}")
    out = Prices(currency=data.get("currency", "USD"), idle_gpu_util_pct=float(data.get("idle_gpu_util_pct", 10)))
    if "electricity_per_kwh" in data:
        out.electricity_per_kwh = float(data["electricity_per_kwh"])
    nodes = data.get("node", [])
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        raise BadInput(f"prices {path}: node must be [[node]] tables")
    for i, n in enumerate(nodes):
        where = f"prices {path} line"
        bad = set(n) - NODE_KEYS
        if bad:
            k = sorted(bad)[0]
            raise BadInput(f"{where} {_line(text, i, k)}: unknown key {k!r} in [[node]] (known: "
                           f"{', '.join(sorted(NODE_KEYS))})")
        text_key = next((k for k in ("name", "hostname", "gpu", "label") if k in n and not isinstance(n[k], str)), None)
        if text_key:
            raise BadInput(f"{where} {_line(text, i, text_key)}: {text_key} must be a string, got "
                           f"{repr(n[text_key])[:40]}")
        price = n.get("per_hour")
        if not is_amount(price):
            raise BadInput(f"{where} {_line(text, i, 'per_hour' if 'per_hour' in n else None)}: [[node]] needs "
                           f"per_hour, a price of 0 or more (got {price!r})")
        market = n.get("market", "on_demand")
        if market not in ("spot", "on_demand"):
            raise BadInput(f"{where} {_line(text, i, 'market')}: market must be spot or on_demand, got {market!r}")
        gpus = n.get("gpus")
        if gpus is not None and (not is_int(gpus) or gpus <= 0):
            raise BadInput(f"{where} {_line(text, i, 'gpus')}: gpus must be a positive integer, got {gpus!r}")
        if "label" in n and "=" not in str(n["label"]):
            raise BadInput(f"{where} {_line(text, i, 'label')}: label must be KEY=VALUE, got {n['label']!r}")
        out.nodes.append(NodePrice(str(n.get("name", f"node{i}")), float(price), market, n.get("hostname"),
                                   n.get("gpu"), n.get("label"), gpus))
    return out


def _waiting_spans(store: Any, job: str) -> dict[str, list[tuple[float, float]]]:
    """node → (start, end) of the waiting rules' spans (a rule event to its rule_end, or to now)."""
    _, rows = store.sql("SELECT node, t, event, json_extract(body, '$.rule') FROM events WHERE job = ? AND event IN "
                        "('rule', 'rule_end') ORDER BY t", (job,))
    spans: dict[str, list[tuple[float, float]]] = {}
    open_at: dict[tuple[str, str], float] = {}
    for node, t, ev, rule in rows:
        if rule not in WAITING_RULES:
            continue
        if ev == "rule":
            open_at.setdefault((node, rule), t)
        elif (node, rule) in open_at:
            spans.setdefault(node, []).append((open_at.pop((node, rule)), t))
    for (node, _), t in open_at.items():
        spans.setdefault(node, []).append((t, float("inf")))
    return spans


def summary(store: Any, job: str, prices: Prices | None = None) -> dict[str, Any]:
    """The job's cost block: per node and in all (see the module's docs)."""
    rows = store.samples_of(job)           # raw and compacted (jobprobe/cluster/compact.py)
    if not rows:
        raise BadInput(f"no samples of job {job!r} in the store")
    waiting = _waiting_spans(store, job)
    _, lost = store.sql("SELECT node, t FROM events WHERE job = ? AND event = 'node_lost'", (job,))
    idle_bound = prices.idle_gpu_util_pct if prices else 10.0
    nodes: dict[str, dict[str, Any]] = {}
    runs: dict[tuple[str, str], list[float]] = {}          # (node, run) → [first t, last t, node seconds]
    for b in rows:
        node, run, t, dt = b["node"], b.get("run", ""), b["t"], b["dt"]
        p = b.get("probes") or {}
        n = nodes.setdefault(node, {"node_s": 0.0, "gpu_s": 0.0, "idle_gpu_s": 0.0, "waiting_gpu_s": 0.0,
                                    "cpu_energy_j": 0.0, "gpu_energy_j": 0.0, "gpu_names": set(), "labels": {},
                                    "gpus_seen": 0})
        n["node_s"] += dt
        r = runs.setdefault((node, run), [t, t, 0.0])
        r[1], r[2] = t, r[2] + dt
        n["labels"].update(b.get("labels") or {})
        gpus = [g for g in ((p.get("gpu") or {}).get("gpus") or []) if isinstance(g, dict) and not g.get("lost")]
        n["gpus_seen"] = max(n["gpus_seen"], len(gpus))
        n["gpu_s"] += dt * len(gpus)
        n["idle_gpu_s"] += dt * sum(1 for g in gpus if g.get("util_gpu_pct", 100) < idle_bound)
        if any(a <= t <= e for a, e in waiting.get(node, ())):
            n["waiting_gpu_s"] += dt * len(gpus)
        n["gpu_names"] |= {g["name"] for g in gpus if g.get("name")}
        en = p.get("energy") or {}
        n["cpu_energy_j"] += float(en.get("cpu_energy_j") or 0) + float(en.get("dram_energy_j") or 0)
        n["gpu_energy_j"] += sum(float(g.get("job_energy_mj") or 0) for g in gpus) / 1000
    # revocations: a node lost while in a run, the job going on afterwards in another run (a restart)
    revoked: dict[str, float] = {}
    for node, t_lost in lost:
        mine = [(run, r) for (nd, run), r in runs.items() if nd == node and r[0] <= t_lost]
        if not mine:
            continue
        run, r = max(mine, key=lambda x: x[1][1])
        if any(run2 != run and r2[0] > t_lost for (_, run2), r2 in runs.items()):
            revoked[node] = revoked.get(node, 0.0) + r[2]
    cur = prices.currency if prices else ""
    out_nodes, total = {}, {"node_hours": 0.0, "gpu_hours": 0.0, "idle_gpu_hours": 0.0, "waiting_gpu_hours": 0.0,
                            "revoked_node_hours": 0.0, "energy_kwh": 0.0, "cpu_energy_j": 0.0, "gpu_energy_j": 0.0}
    money = {"node": 0.0, "energy": 0.0, "idle_gpu": 0.0, "waiting_gpu": 0.0, "revoked": 0.0}
    unpriced = []
    for node, n in sorted(nodes.items()):
        kwh = (n["cpu_energy_j"] + n["gpu_energy_j"]) / 3.6e6
        o = {"node_hours": n["node_s"] / 3600, "gpu_hours": n["gpu_s"] / 3600, "idle_gpu_hours": n["idle_gpu_s"] / 3600,
             "waiting_gpu_hours": n["waiting_gpu_s"] / 3600, "revoked_node_hours": revoked.get(node, 0.0) / 3600,
             "cpu_energy_j": n["cpu_energy_j"], "gpu_energy_j": n["gpu_energy_j"], "energy_kwh": kwh}
        for k in total:
            total[k] += o[k]
        price = prices.match(node, n["gpu_names"], n["labels"]) if prices else None
        if price is not None:
            gpus = price.gpus or n["gpus_seen"] or 1
            gpu_hour = price.per_hour / gpus
            o.update(price=price.name, market=price.market, per_hour=price.per_hour,
                     cost=o["node_hours"] * price.per_hour,
                     idle_gpu_cost=o["idle_gpu_hours"] * gpu_hour, waiting_gpu_cost=o["waiting_gpu_hours"] * gpu_hour,
                     revoked_cost=o["revoked_node_hours"] * price.per_hour)
            if prices.electricity_per_kwh is not None:
                o["energy_cost"] = kwh * prices.electricity_per_kwh
            money["node"] += o["cost"]
            money["energy"] += o.get("energy_cost", 0.0)
            money["idle_gpu"] += o["idle_gpu_cost"]
            money["waiting_gpu"] += o["waiting_gpu_cost"]
            money["revoked"] += o["revoked_cost"]
        elif prices is not None:
            unpriced.append(node)
        out_nodes[node] = o
    t0, t1 = rows[0]["t"] - rows[0]["dt"], rows[-1]["t"]
    hours = max(t1 - t0, 1e-9) / 3600
    out: dict[str, Any] = {"job": job, "run_hours": hours, "nodes": out_nodes, **total}
    if prices is not None:
        cost = money["node"] + money["energy"]
        out.update(currency=cur, cost=cost, node_cost=money["node"], energy_cost=money["energy"],
                   cost_per_hour=cost / hours, idle_gpu_cost=money["idle_gpu"], waiting_gpu_cost=money["waiting_gpu"],
                   revoked_cost=money["revoked"], unpriced_nodes=unpriced)
    return out


def text(s: dict[str, Any]) -> str:
    """The cost block a person reads."""
    cur = s.get("currency", "")
    lines = [f"job {s['job']}: {s['run_hours']:.2f} h of run on {len(s['nodes'])} node(s)"]
    if "cost" in s:
        lines.append(f"  cost            {s['cost']:,.2f} {cur}  ({s['node_cost']:,.2f} nodes + "
                     f"{s['energy_cost']:,.2f} "
                     f"energy; {s['cost_per_hour']:,.2f} {cur}/h of run)")
    lines.append(f"  node-hours      {s['node_hours']:.3f}    GPU-hours {s['gpu_hours']:.3f}")
    lines.append(f"  energy          {s['energy_kwh']:.4f} kWh  (CPU+DRAM {s['cpu_energy_j'] / 3.6e6:.4f}, GPU "
                 f"{s['gpu_energy_j'] / 3.6e6:.4f})")
    waste = f"  wasted          idle GPU {s['idle_gpu_hours']:.3f} GPU-h, waiting GPU {s['waiting_gpu_hours']:.3f} " \
            f"GPU-h, revoked {s['revoked_node_hours']:.3f} node-h"
    if "cost" in s:
        waste += f"  = {s['idle_gpu_cost'] + s['waiting_gpu_cost'] + s['revoked_cost']:,.2f} {cur}"
    lines.append(waste)
    for node, o in s["nodes"].items():
        price = f"{o['price']} ({o['market']}) {o['cost']:,.2f} {cur}" if "cost" in o else \
            ("no price" if "cost" in s else "")
        lines.append(f"    {node:<16} {o['node_hours']:.3f} node-h {o['gpu_hours']:.3f} GPU-h "
                     f"{o['energy_kwh']:.4f} kWh {price}".rstrip())
    if s.get("unpriced_nodes"):
        lines.append(f"  no price for: {', '.join(s['unpriced_nodes'])} (add a [[node]] entry that matches them)")
    return "\n".join(lines)


KEEP_ENDED = 1000    # ended jobs whose energy and cost the controller's /metrics still says


class Meter:
    """Running totals per job for the controller's Prometheus metrics: energy (J) and, with prices, money — added
    as each sample frame is stored (counters since the controller started)."""

    def __init__(self, prices: Prices | None = None):
        self.prices = prices
        self.energy: dict[str, float] = {}
        self.cost: dict[str, float] = {}
        self.ended: dict[str, None] = {}      # jobs that ended, oldest first: the newest KEEP_ENDED keep their totals

    def end(self, job: str) -> None:
        """The job ended: its totals stay for the newest KEEP_ENDED ended jobs (a scrape sees their last value),
        then go — a month of short jobs is not a series each forever."""
        self.ended.pop(job, None)
        self.ended[job] = None
        while len(self.ended) > KEEP_ENDED:
            old = next(iter(self.ended))
            del self.ended[old]
            self.energy.pop(old, None)
            self.cost.pop(old, None)

    def add(self, frame: dict) -> None:
        if frame.get("kind") != "sample":
            return
        p, job = frame.get("probes") or {}, frame["job"]
        self.ended.pop(job, None)
        gpus = [g for g in ((p.get("gpu") or {}).get("gpus") or []) if isinstance(g, dict) and not g.get("lost")]
        en = p.get("energy") or {}
        j = float(en.get("cpu_energy_j") or 0) + float(en.get("dram_energy_j") or 0) + \
            sum(float(g.get("job_energy_mj") or 0) for g in gpus) / 1000
        self.energy[job] = self.energy.get(job, 0.0) + j
        if self.prices is not None:
            price = self.prices.match(frame["node"], {g["name"] for g in gpus if g.get("name")},
                                      frame.get("labels") or {})
            if price is not None:
                c = float(frame.get("dt") or 0) / 3600 * price.per_hour
                if self.prices.electricity_per_kwh is not None:
                    c += j / 3.6e6 * self.prices.electricity_per_kwh
                self.cost[job] = self.cost.get(job, 0.0) + c
