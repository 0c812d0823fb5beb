# SPDX-License-Identifier: Apache-2.0
"""`jobprobe report`: a page a person opens. Checked in a real browser (headless Chromium, Debian `chromium`): it
loads with no console error, the verdict is in the DOM, and a screenshot shows the plots (its pixels are not
blank: the plot lines' colours are there). The screenshot is kept under out/ as an artifact. The verdict is
checked against the events and frames it was made from."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
need_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                   reason="chromium is not installed (scripts/setup.sh installs it)")
sys.path.insert(0, str(REPO / "scripts"))


def jobprobe(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobprobe.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, **kw)


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0", *args], capture_output=True, text=True, timeout=120)


def test_a_big_jobs_report_names_its_straggler_and_stays_small(tmp_path):
    """8 nodes for an hour (frames made by the real frame builder, scripts/report_cost.py): the page is at most
    5 MB, its verdict names the straggler of the events with the share of the run the events say."""
    import report_cost
    paths = report_cost.make(tmp_path, nodes=8, seconds=3600)
    r = jobprobe("report", *paths, "-o", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    assert len(page.encode()) <= 5 << 20
    verdict = re.search(r'id="verdict">(.*?)</p>', page, re.S)[1]
    # the straggler: since t0+1200 until its end event at t0+1815 → 615 s of a 3599 s run
    assert "<b>node-02</b> was the straggler for 615 s (17% of the run), throttled by its CPU limit" in verdict
    assert "0.80 s per second more" in verdict and "8 node(s)" in verdict and "GPUs" in verdict
    assert page.count("<svg") >= 8
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)     # self-contained: nothing to fetch
    # it opens with the job's summary: the goodput `jobprobe summary` gives for the same frames
    import json
    s = json.loads(jobprobe("summary", "--format", "json", *paths).stdout)
    assert page.index('id="summary"') < page.index('id="verdict"')
    assert f"goodput <b>{100 * s['goodput']:.0f}%</b>" in page and s["nodes"] == 8 and s["stragglers"][0]["s"] == 615


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in (["report"], ["report", str(tmp_path / "none.mpk")], ["report", "--store", str(tmp_path / "x.db")],
                 ["report", "--store", str(tmp_path / "x.db"), "--job", "j"]):
        r = jobprobe(*args, "-o", str(tmp_path / "r.html"))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


@pytest.mark.kernel
@need_chromium
def test_the_report_of_a_real_job_opens_in_a_browser_with_its_plots(tmp_path):
    out = REPO / "out"
    out.mkdir(exist_ok=True)
    frames = tmp_path / "job.mpk"
    r = jobprobe("run", "--out", str(frames), "--probes", "cgroup,sched,net,nic,self", "--interval", "0.5", "--",
                 sys.executable, "scripts/train_cpu.py", "--steps", "6")
    assert r.returncode == 0, r.stderr
    page = tmp_path / "report.html"
    r = jobprobe("report", str(frames), "-o", str(page))
    assert r.returncode == 0, r.stderr
    dom = chromium("--dump-dom", f"file://{page}")
    assert dom.returncode == 0, dom.stderr
    assert 'id="verdict"' in dom.stdout and "ran" in dom.stdout and "<svg" in dom.stdout
    errors = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not errors, errors
    shot = out / "report-screenshot.png"
    shot.unlink(missing_ok=True)
    s = chromium("--window-size=1280,1800", f"--screenshot={shot}", f"file://{page}")
    assert s.returncode == 0 and shot.exists(), s.stderr
    import matplotlib.image
    import numpy as np
    img = (matplotlib.image.imread(str(shot))[:, :, :3] * 255).round().astype(int)
    not_white = (img.sum(axis=2) < 3 * 245).mean()
    colours = {tuple(c) for c in img.reshape(-1, 3)[::7]}
    blue = np.all(np.abs(img - np.array([31, 119, 180])) <= 12, axis=2).sum()     # matplotlib's first line colour
    print(f"report: screenshot {shot}: {not_white:.1%} not white, {len(colours)} colours, {blue} plot-blue pixels")
    assert not_white > 0.03 and len(colours) > 50 and blue > 300


# mathtext that does not parse (`\\` then letters; `^` with nothing after), one that does (drawn as a formula, not
# as the name), a lone `$`, a leading `_` (what matplotlib's legend leaves out), markup and comment ends
HOSTILE_NODES = [r"n$\\frac{1}{0}$1", "$x^$", r"m$\frac{1}{0}$1", "a$b", "_hidden", "</svg><script>alert(1)</script>",
                 "x-->y<!--z"]
HOSTILE_JOB = "$x^$"


def hostile_frames(seconds: int = 20) -> list[dict]:
    """A short job on the HOSTILE_NODES, each node's samples filling every plot of the page."""
    from jobprobe.cluster.report import OFFCPU
    from jobprobe.core.frame import FrameBuilder
    frames = []
    t0 = 1_700_000_000.0
    for i, node in enumerate(HOSTILE_NODES):
        fb = FrameBuilder(node=node, job=HOSTILE_JOB, run=f"r{i}")
        for s in range(seconds):
            probes = {"cgroup": {"cpu_user_ns": int(1e9 + i * 1e8), "mem_bytes": 1 << 30},
                      "sched": {"runq_lat_ns": int(1e7), **{f"offcpu_{r}_ns": int(1e8) for r in OFFCPU}},
                      "self": {"cpu_cores": 0.004, "rss_bytes": 30 << 20}}
            frames.append(fb.sample(t0 + s, 1.0, probes, {p: "ok" for p in probes}))
    fb = FrameBuilder(node=HOSTILE_NODES[0], job=HOSTILE_JOB, run="r0")
    frames.append(fb.event(t0 + 5, "straggler", straggler=HOSTILE_NODES[0], causes=["cpu_throttled"], since=t0 + 4,
                           reason="$\\frac{1}{0}$", evidence={}))
    frames.append(fb.event(t0 + 9, "straggler_end", straggler=HOSTILE_NODES[0]))
    return frames


def check_hostile_page(page: str) -> None:
    """Every name is in the page as text, escaped, and never as markup."""
    import html
    for name in HOSTILE_NODES + [HOSTILE_JOB]:
        assert html.escape(name) in page, name
    assert "<script>" not in page and "</svg><script>" not in page
    assert "x-->y" not in page                                     # the SVG's comments stay comments
    assert f"<h1>{html.escape(HOSTILE_JOB)}</h1>" in page
    assert page.count("<svg") == page.count("</svg>") >= 4          # every plot drawn, none cut open


def test_names_from_frames_are_text_never_mathtext_or_markup(tmp_path):
    """A node `n$\\\\frac{1}{0}$1` (mathtext that does not parse) and a job `$x^$`: the page is made, from frame
    files through the CLI and from the controller's store, and every name in it is escaped text."""
    from jobprobe.cluster.store import Store
    from jobprobe.core.frame import encode
    frames = hostile_frames()
    path = tmp_path / "job.mpk"
    path.write_bytes(b"".join(encode(f) for f in frames))
    r = jobprobe("report", str(path), "-o", str(tmp_path / "files.html"))
    assert r.returncode == 0, r.stderr
    check_hostile_page((tmp_path / "files.html").read_text())
    st = Store(tmp_path / "store.db")
    st.add(frames)
    st.close()
    r = jobprobe("report", "--store", str(tmp_path / "store.db"), "--job", HOSTILE_JOB, "-o",
                 str(tmp_path / "store.html"))
    assert r.returncode == 0, r.stderr
    check_hostile_page((tmp_path / "store.html").read_text())


def test_the_plots_draw_names_as_they_are_whatever_the_rc(tmp_path, monkeypatch):
    """The legend lists every node, `_hidden` included, each drawn as its literal name — even with a matplotlibrc
    that asks for TeX (no LaTeX is installed on a node: that would fail too)."""
    import matplotlib

    from jobprobe.cluster import report
    job = report.Job()
    job.take(hostile_frames())
    job.sort()
    seen: list[str] = []
    real = report._svg

    def svg(fig):                                  # each figure's texts, as matplotlib will draw them
        fig.canvas.draw()
        for text in fig.findobj(matplotlib.text.Text):
            assert not text.get_usetex() and not text.get_parse_math(), text.get_text()
            seen.append(text.get_text())
        return real(fig)
    monkeypatch.setattr(report, "_svg", svg)
    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", True)
    plots = report.timelines(job)
    assert len(plots) >= 4
    for name in HOSTILE_NODES:
        assert seen.count(name) >= len(plots), name          # in every legend (and the off-CPU plot's ticks)
    assert matplotlib.rcParams["text.usetex"] is True         # the caller's settings are left as they were


def test_the_verdict_names_who_waited_and_tells_a_fault_from_the_jobs_own_imbalance():
    """One sentence per finding: node-b the straggler, short of CPU, node-a and node-c waiting for it; later node-c
    given more work — the job's own imbalance, not its node, node-a and node-b waiting. A waited_by that is not a
    list (a hostile file) adds nobody."""
    from jobprobe.cluster.report import Job, verdict
    job = Job("ddp")
    frames = [{"kind": "sample", "node": n, "job": "ddp", "t": 1000.0 + s, "dt": 1.0,
               "probes": {"cgroup": {"cpu_user_ns": 9e8, "cpu_system_ns": 0}}}
              for n in ("node-a", "node-b", "node-c") for s in range(101)]
    events = [{"kind": "event", "event": "straggler", "node": "node-b", "straggler": "node-b", "t": 1030.0,
               "since": 1020.0, "causes": ["runq"], "waited_by": ["node-c", "node-a"], "reason": "r",
               "evidence": {}},
              {"kind": "event", "event": "straggler_end", "node": "node-b", "straggler": "node-b", "t": 1040.0},
              {"kind": "event", "event": "imbalance", "node": "node-c", "t": 1070.0, "since": 1060.0,
               "waited_by": ["node-a", "node-b"]},
              {"kind": "event", "event": "imbalance_end", "node": "node-c", "t": 1090.0},
              {"kind": "event", "event": "imbalance", "node": "node-x", "t": 1095.0, "since": 1095.0,
               "waited_by": "node-a"}]
    job.take(frames + events)
    job.sort()
    v = verdict(job)
    assert ("<b>node-b</b> was the straggler for 20 s (20% of the run), short of CPU (run queue); node-a, node-c "
            "waited for it.") in v, v
    assert ("<b>node-c</b> had more work than its peers for 30 s (30% of the run): the job's own imbalance, not its "
            "node; node-a, node-b waited for it.") in v, v
    assert "<b>node-x</b> had more work than its peers for 5 s (5% of the run): the job's own imbalance, not its " \
           "node." in v and "No straggler" not in v


def test_the_header_says_the_summarys_wall_the_title_what_ran_and_the_axes_start_at_zero():
    """Issue 49's walk: the header said 35 s over a table of 36 s (the frames' own times leave the first interval
    out), the title was the generated job name (`python-4242-1796…`), the CPU axis started at the data's minimum."""
    from jobprobe.cluster import report, summary
    from jobprobe.core.frame import FrameBuilder
    fb = FrameBuilder("n1", "python-4242-1796660000", run="r0")
    t0 = 1_796_660_000.0
    frames = [{**fb.hello(probes={}), "target": {"kind": "cgroup", "command": "python train.py --epochs 3"}}]
    frames += [fb.sample(t0 + s, 1.0, {"cgroup": {"cpu_user_ns": int((1.5 + 0.1 * (s % 3)) * 1e9),
                                                  "cpu_system_ns": 0}}, {"cgroup": "ok"}) for s in range(1, 37)]
    s = summary.summarize(frames)
    job = report.Job()
    job.take(frames)
    job.sort()
    page = report.render(job, top=summary.html_table(s))
    assert s["wall_s"] == 36 and "(36 s)" in page and "36 s of wall time" in page
    assert "<title>python train.py --epochs 3 — jobprobe report</title>" in page
    assert "<h1>python train.py --epochs 3</h1>" in page and "job python-4242-1796660000" in page
    import matplotlib
    matplotlib.use("Agg")
    with matplotlib.rc_context(report.PLAIN_TEXT):
        import matplotlib.pyplot as plt
        real = plt.subplots
        axes = []

        def spy(*a, **k):
            fig, ax = real(*a, **k)
            axes.append(ax)
            return fig, ax
        plt.subplots = spy
        try:
            report._timelines(job)
        finally:
            plt.subplots = real
    assert axes and all(ax.get_ylim()[0] == 0 for ax in axes[:1])       # the CPU panel, first
