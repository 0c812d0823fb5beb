# SPDX-License-Identifier: Apache-2.0
"""`jobprobe jobs`: the operator's table of the jobs that ended in a window, from the controller's store. Ten jobs
of different ends and owners through the controller (their frames ingested as the stream gives them), then the
CLI as an operator runs it, in each format: every row right, against what each job's frames said."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobprobe.cluster.controller import Controller
from jobprobe.cluster.jobs import parse_since
from jobprobe.cluster.store import Store
from jobprobe.core.errors import BadInput
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.core.wire import subject_of

REPO = Path(__file__).resolve().parents[1]
# each job's last frame's `end`, and what its row must say: how it ended, whether that was a failure
ENDS = [({"exit_code": 0}, "exit 0", False), ({"cause": "exit", "exit_code": 3}, "exit 3", True),
        ({"signal": 9}, "SIGKILL", True), ({"cause": "group_removed"}, "group removed", False), (None, "", False),
        ({"cause": "signal", "signal": 15}, "SIGTERM", True),
        ({"cause": "oom_kill", "signal": 9, "oom_kills": 2}, "OOM kill (SIGKILL)", True),
        ({"exit_code": 1}, "exit 1", True), (None, "", False), ({"cause": "group_removed", "exit_code": 0},
                                                                 "group removed (exit 0)", False)]


def jobs_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobprobe.cli", "jobs", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_ten_jobs_of_different_ends_and_owners_each_in_its_row(tmp_path):
    ctl = Controller(Store(tmp_path / "s.db"), "nats://unused")
    now = time.time() - 300.0         # the controller's clock and the nodes' (one clock), 5 minutes ago

    def send(frames):
        ctl.ingest([SimpleNamespace(subject=subject_of(f), data=encode(f)) for f in frames], now=now)
    want = {}
    for k, (end, how, bad) in enumerate(ENDS):
        job, nodes = f"job{k}", ["a", "b"] if k == 4 else ["a"]
        labels = {"user": f"u{k % 3}", "account": f"acct{k % 2}"}
        bs = {n: FrameBuilder(n, job, f"r{k}{n}") for n in nodes}
        for b in bs.values():
            b.labels = labels
        send([{**b.hello(probes={}), "interval": 1.0} for b in bs.values()])
        start = now
        for i in range(6):                    # 6 s: 1 of startup, then computing at 2 cores
            now += 1
            cores = 0.05 if i == 0 else 2.0
            send([b.sample(now, 1.0, {"cgroup": {"cpu_user_ns": int(cores * 1e9), "cpu_system_ns": 0}},
                           {"cgroup": "ok"}, end={"why": "exited", **end} if end and i == 5 else None)
                  for b in bs.values()])
        beats = {n: FrameBuilder(n, "node", f"b{k}{n}") for n in "ab"}
        for _ in range(5):                    # its nodes alive, silent about it: it ends
            now += 1
            send([b.heartbeat(now, 1.0, 0, False) for b in beats.values()])
        want[job] = {"owner": labels, "nodes": len(nodes), "start": start, "end": how, "failed": bad}
    ctl.store.close()
    r = jobs_cli("--store", str(tmp_path / "s.db"), "--since", "2h", "--format", "json")
    assert r.returncode == 0, r.stderr
    got = {x["job"]: x for x in json.loads(r.stdout)}
    assert set(got) == set(want)
    for job, w in want.items():
        g = got[job]
        assert {k: g[k] for k in ("owner", "nodes", "end", "failed")} == \
            {k: w[k] for k in ("owner", "nodes", "end", "failed")}, (job, g, w)
        assert abs(g["start"] - w["start"]) < 1.01 and abs(g["wall_s"] - 6) < 0.01, (job, g)
        # a failed job with no checkpoint lost all its computing: its largest badput, its goodput nothing
        assert g["badput"] == ("lost" if w["failed"] else "startup"), g
        assert (g["goodput"] == 0) == w["failed"], g
    # newest first by default; by goodput, the lowest first
    assert [x["job"] for x in json.loads(r.stdout)] == [f"job{k}" for k in reversed(range(10))]
    r = jobs_cli("--store", str(tmp_path / "s.db"), "--since", "2h", "--format", "csv", "--sort", "goodput")
    table = list(csv.DictReader(io.StringIO(r.stdout)))
    assert {x["job"] for x in table[:5]} == {"job1", "job2", "job5", "job6", "job7"} and len(table) == 10
    assert table[0]["owner"] == "account=acct1,user=u1" and table[0]["failed"] == "True"
    text = jobs_cli("--store", str(tmp_path / "s.db")).stdout
    assert "10 jobs, 5 failed" in text and "exit 3 FAILED" in text and "SIGKILL FAILED" in text
    assert "no job ended" in jobs_cli("--store", str(tmp_path / "s.db"), "--since", "1s").stdout
    # the owner in the summary too (the controller's summary event, `summary --format json`)
    summaries = {j: json.loads(b) for j, b in Store(tmp_path / "s.db", readonly=True).sql(
        "SELECT job, body FROM events WHERE event = 'summary'")[1]}
    assert all(summaries[j]["labels"] == w["owner"] for j, w in want.items()), summaries["job0"]["labels"]
    # with prices: each job's cost, from its node-hours (node a at 3.6 an hour: 1 EUR a 1000 s; each job 6 s on each
    # of its nodes, the node b unpriced: its part not counted)
    (tmp_path / "p.toml").write_text('currency = "EUR"\n[[node]]\nname = "a-nodes"\nhostname = "a"\nper_hour = 3.6\n')
    r = jobs_cli("--store", str(tmp_path / "s.db"), "--since", "2h", "--format", "json", "--prices",
                 str(tmp_path / "p.toml"))
    cost = {x["job"]: (x["cost"], x["currency"]) for x in json.loads(r.stdout)}
    assert cost == {f"job{k}": (round(6 / 1000, 2), "EUR") for k in range(10)}, cost
    assert "EUR" in jobs_cli("--store", str(tmp_path / "s.db"), "--since", "2h", "--prices",
                             str(tmp_path / "p.toml")).stdout


def test_the_jobs_page_links_each_jobs_report_and_escapes_what_owners_wrote(tmp_path):
    """`jobprobe report --jobs`: the jobs of the window as one page, each name a link to its own report written
    beside it (`--max-reports` newest; the rest listed unlinked); a job's name and labels — its owner's to write —
    escaped in the page and made safe as a file name (no path out of the directory)."""
    import html.parser
    ctl = Controller(Store(tmp_path / "s.db"), "nats://unused")
    now = time.time() - 300.0
    names = ["train-1", "eval/../../x", '<script>alert(1)</script>"']

    def send(frames):
        ctl.ingest([SimpleNamespace(subject=subject_of(f), data=encode(f)) for f in frames], now=now)
    for k, job in enumerate(names):
        b = FrameBuilder("a", job, f"r{k}")
        b.labels = {"user": "<b>eve</b>"}
        send([{**b.hello(probes={}), "interval": 1.0}])
        for i in range(5):
            now += 1
            send([b.sample(now, 1.0, {"cgroup": {"cpu_user_ns": 10 ** 9, "cpu_system_ns": 0}}, {"cgroup": "ok"},
                           end={"why": "exited", "exit_code": k} if i == 4 else None)])
        beat = FrameBuilder("a", "node", f"b{k}")
        for _ in range(5):
            now += 1
            send([beat.heartbeat(now, 1.0, 0, False)])
    ctl.store.close()
    out = tmp_path / "site" / "jobs.html"
    out.parent.mkdir()
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "report", "--jobs", "--store", str(tmp_path / "s.db"),
                        "--since", "2h", "--max-reports", "2", "-o", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr

    class Rows(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.links, self.scripts = [], {}, 0
            self._href = None

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append([])
            elif tag == "td":
                self.rows[-1].append("")
            elif tag == "a":
                self._href = dict(attrs)["href"]
            elif tag == "script":
                self.scripts += 1

        def handle_data(self, data):
            if self.rows and self.rows[-1]:
                self.rows[-1][-1] += data
                if self._href:
                    self.links[data] = self._href

        def handle_endtag(self, tag):
            if tag == "a":
                self._href = None
    page = Rows()
    page.feed(out.read_text())
    rows = {row[0]: row for row in page.rows[1:]}
    assert set(rows) == set(names) and page.scripts == 0, page.rows
    assert all(row[1] == "user=<b>eve</b>" for row in rows.values())          # shown as text, not markup
    assert [rows[n][5] for n in names] == ["exit 0", "exit 1 FAILED", "exit 2 FAILED"]
    assert set(page.links) == set(names[1:]) and names[0] not in page.links     # the newest two have reports
    for name, href in page.links.items():
        assert "/" not in href and not href.startswith(".")
        report = out.parent / href
        assert report.resolve().parent == out.parent.resolve() and report.stat().st_size > 1000, href
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["jobs.html", *page.links.values()])


def test_a_window_that_is_no_length_of_time_is_refused_in_one_line(tmp_path):
    assert parse_since("90s") == 90 and parse_since("1.5h") == 5400 and parse_since("2w") == 14 * 86400
    for bad in ("", "1", "1y", "-1d", "0d", "1d2h", "d"):
        with pytest.raises(BadInput):
            parse_since(bad)
    r = jobs_cli("--store", str(tmp_path), "--since", "1y")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--since" in r.stderr
