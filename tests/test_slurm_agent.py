# SPDX-License-Identifier: Apache-2.0
"""Jobs attached by the scheduler: scripts/slurm/prolog and epilog on a real SLURM 22.05 (tests/slurm_cluster.py, with
Prolog=, Epilog= and PrologFlags=Alloc) driving a real `jobprobe agent`. Nobody types `attach`: each job submitted
with sbatch is probed from its first process, its frames carry its SLURM names, its CPU time agrees with the job's
own getrusage, and it is let go when it ends — a job of an unprivileged user, an array job, a job that fails, a job
cancelled mid-run, and a job that starts while the agent is down (attached when the agent comes back, from squeue).

The independent source for CPU time is the job's own account (the burner's getrusage at its exit, in its output
file): this cluster runs without slurmdbd, so sacct has nothing to say.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IS_ROOT
from conftest import until as wait_for
from jobprobe.core.frame import StreamReader

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
PYTHON = "/usr/bin/python3"         # the job's interpreter: the system one, usable by any user

pytestmark = [pytest.mark.integration, pytest.mark.kernel]




class Agent:
    """A real `jobprobe agent` for the cluster's node, on a socket the prolog and epilog wrappers name."""

    def __init__(self, base: Path, env: dict[str, str], node: str):
        from conftest import free_port
        self.base, self.env, self.node = base, env, node
        self.sock, self.out = base / "agent.sock", base / "out"
        self.proc: subprocess.Popen | None = None
        self.prometheus = f"127.0.0.1:{free_port()}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobprobe.cli", "agent", "--socket", str(self.sock), "--state",
             str(self.base / "jobs.json"), "--out", str(self.out), "--interval", "0.5", "--probes", "cgroup,perf,nic",
             "--slurm", "--slurm-node", self.node, "--prometheus", self.prometheus], cwd=REPO, env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(self.base / "agent.log", "ab"))
        wait_for(lambda: self.ready(), 60, "the agent to answer on its socket")

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the agent exited: {(self.base / 'agent.log').read_text()[-2000:]}")
        try:
            return bool(self.status())
        except Exception:
            return False

    def status(self) -> dict:
        from jobprobe.node.control import call
        return call(str(self.sock), {"cmd": "status"})

    def attached(self, job: str) -> bool:
        return any(j["job"] == job for j in self.status()["jobs"])

    def ended(self, job: str) -> dict | None:
        return next((r for r in self.status()["recent"] if r["job"] == job), None)

    def frames(self, job: str) -> list[dict]:
        with open(self.out / f"{job}.mpk", "rb") as f:
            return list(StreamReader(f))

    def end(self, job: str) -> dict:
        """The `end` of the job's last frame ({} where it has none)."""
        return [f for f in self.frames(job) if f["kind"] == "sample"][-1].get("end", {})

    def metrics(self) -> list:
        """/metrics, read with prometheus-client's own parser: every sample."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families
        text = urllib.request.urlopen(f"http://{self.prometheus}/metrics", timeout=5).read().decode()
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def site():
    """The cluster with the prolog and epilog in its slurm.conf, and the agent; the job's files in a directory any
    user can read (workloads.py) and write (its output)."""
    if not IS_ROOT:
        pytest.skip("needs root to start slurmctld, slurmd and munged")
    from slurm_cluster import SlurmCluster
    cluster = SlurmCluster()
    base = cluster.base
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)
    jobs = base / "jobs"
    shutil.rmtree(jobs, ignore_errors=True)
    jobs.mkdir()
    os.chmod(jobs, 0o1777)
    shutil.copy(TESTS / "workloads.py", jobs / "workloads.py")
    os.chmod(jobs / "workloads.py", 0o644)
    for name in ("prolog", "epilog"):
        # slurmd gives a prolog only the job's SLURM_* variables: the wrapper names the socket, and times the run
        wrapper = base / f"{name}.sh"
        wrapper.write_text(f"""#!/bin/sh
t0=$(date +%s%N)
JOBPROBE_SOCKET={base}/agent.sock JOBPROBE_SUMMARY=1 JOBPROBE_BIN={REPO}/.venv/bin/jobprobe \
SLURM_CONF={cluster.conf} {PYTHON} {REPO}/scripts/slurm/{name} 2>>{base}/{name}.err
rc=$?
echo "$SLURM_JOB_ID $rc $(( $(date +%s%N) - t0 ))" >> {base}/{name}.log
exit $rc
""")
        wrapper.chmod(0o755)
        (base / f"{name}.log").unlink(missing_ok=True)
        (base / f"{name}.err").unlink(missing_ok=True)
    cluster.extra_conf = f"Prolog={base}/prolog.sh\nEpilog={base}/epilog.sh\nPrologFlags=Alloc\n"
    shutil.rmtree(base / "out", ignore_errors=True)
    (base / "jobs.json").unlink(missing_ok=True)
    cluster.start()
    agent = Agent(base, cluster.env, cluster.node)
    try:
        agent.start()
        yield cluster, agent, jobs
    finally:
        agent.stop()
        cluster.stop()


def runs(base: Path, name: str, job: str) -> list[tuple[int, float]]:
    """(exit code, seconds) of each run of the prolog or epilog wrapper for `job`."""
    try:
        lines = (base / f"{name}.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(int(rc), int(ns) / 1e9) for j, rc, ns in (ln.split() for ln in lines) if j == job]


def burn_script(jobs: Path, seconds: float, after: str = "") -> str:
    """A job burning `seconds` of its own CPU time (not of wall time: beside other work it takes longer, and uses
    as much)."""
    return f"exec {PYTHON} {jobs}/workloads.py burncpu {seconds}" if not after else \
        f"{PYTHON} {jobs}/workloads.py burncpu {seconds}; {after}"


def said(cluster, frames: list[dict]) -> dict:
    """What a failed CPU check prints: each sample's interval, CPU, processes and threads gone uncounted, the
    target, the prolog's runs and the agent's log."""
    hello = next((f for f in frames if f["kind"] == "hello"), {})
    job = hello.get("job")
    return dict(samples=[(f["dt"], cpu([f]), f["probes"]["cgroup"]["nprocs"], f["probes"]["cgroup"]["exits_uncounted"])
                         for f in frames if f["kind"] == "sample"],
                target=hello.get("target"), from_start=hello.get("from_start"),
                prolog=runs(cluster.base, "prolog", job), log=(cluster.base / "agent.log").read_text()[-1500:])


def cpu(frames: list[dict]) -> int:
    return sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"]
               for f in frames if f["kind"] == "sample")


def test_a_job_of_an_unprivileged_user_is_probed_from_its_first_process_to_its_last(site):
    cluster, agent, jobs = site
    mine = jobs / "my runs"                 # a space in the output's directory (scontrol's text: words cut it there)
    mine.mkdir(exist_ok=True)
    os.chmod(mine, 0o1777)
    out = mine / "nobody.out"
    res = subprocess.run(["runuser", "-u", "nobody", "--", "sbatch", "--parsable", "--chdir", str(jobs), "-o", str(out),
                          "-J", "mine", "-A", "ml-team", "--wrap", burn_script(jobs, 2)], capture_output=True,
                         text=True,
                         env=cluster.env, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    wait_for(lambda: cluster.job_state(job) == "COMPLETED", 60, f"job {job} to complete")
    ended = wait_for(lambda: agent.ended(job), 20, f"the agent to let job {job} go")
    # let go by whichever came first: the agent seeing the last process exit, or the epilog's detach
    assert "exited" in ended["why"] or ended["why"] == "detached", ended
    assert not agent.attached(job)

    frames = agent.frames(job)
    hello = frames[0]
    assert hello["kind"] == "hello" and hello["job"] == job and hello["from_start"] is True
    labels = hello["labels"]
    assert (labels["slurm_job_id"], labels["user"], labels["partition"]) == (job, "nobody", "debug"), labels
    assert labels["uid"] == str(int(subprocess.run(["id", "-u", "nobody"], capture_output=True,
                                                   text=True).stdout))
    assert all(f["labels"]["slurm_job_id"] == job for f in frames)
    # its owner on every series of the job in /metrics (its series stay a minute after it ended), and its end
    series = [x for x in agent.metrics() if x.labels.get("job") == job]
    assert series and all((x.labels["user"], x.labels["account"], x.labels["partition"]) == ("nobody", "ml-team",
                                                                                             "debug")
                          for x in series), series[:3]
    assert (agent.end(job).get("cause"), agent.end(job).get("exit_code")) == ("exit", 0), agent.end(job)
    assert any(f.get("labels", {}).get("slurm_steps") == "batch" for f in frames if f["kind"] == "sample"), \
        [f["labels"] for f in frames]
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    # `nic` from the prolog's attach to the job's end, in the job's network namespace (the node's, here): the
    # interfaces the kernel lists there, in every sample
    samples = [f for f in frames if f["kind"] == "sample"]
    assert all(f["status"].get("nic") == "ok" for f in samples), [f["status"] for f in samples]
    here = set(os.listdir("/sys/class/net"))
    assert all(f["probes"]["nic"]["netns"] == "host" and f["probes"]["nic"]["nics"] and
               {n["name"] for n in f["probes"]["nic"]["nics"]} <= here for f in samples[1:]), samples[-1]["probes"]
    # The job's own account (getrusage at its exit) against the sum of its frames, the part before the attach
    # included (from_start): per-thread clock ticks at each read (10 ms each, a few reads) and the interpreter's
    # teardown after it printed are the difference: 40 ms + 2%.
    own = int(out.read_text().split("cpu_ns=")[1].split()[0])
    seen = cpu(frames)
    assert own > 1.5e9, own
    assert abs(seen - own) <= 40e6 + 0.02 * own, dict(own=own, seen=seen)
    # the prolog and epilog each ran once, exited 0, and did not hold the job up (a generous guard against a hang:
    # their real duration is measured by scripts/prolog_time.py)
    for name in ("prolog", "epilog"):
        assert [rc for rc, _ in runs(cluster.base, name, job)] == [0], (name, runs(cluster.base, name, job))
        assert all(s < 5 for _, s in runs(cluster.base, name, job))
    # the epilog (JOBPROBE_SUMMARY=1) left the job's summary beside its output, written as the job's user: the page
    # `jobprobe summary` makes of the job's frames
    page = mine / f"jobprobe-{job}.txt"
    assert page.exists(), (cluster.base / "epilog.err").read_text()[-1000:]
    assert page.stat().st_uid == int(labels["uid"])
    ours = subprocess.run([str(REPO / ".venv" / "bin" / "jobprobe"), "summary", str(agent.out / f"{job}.mpk")],
                          capture_output=True, text=True, timeout=60)
    assert page.read_text() == ours.stdout and f"job {job} on 1 node" in ours.stdout, (page.read_text(), ours)


def test_an_array_job_each_task_its_own_job(site):
    cluster, agent, jobs = site
    array = cluster.sbatch("--array=1-3", "--chdir", str(jobs), "-o", str(jobs / "array-%a.out"), "-J", "arr",
                           "--wrap", burn_script(jobs, 1))

    def tasks() -> dict[str, dict]:
        found = {}
        for path in agent.out.glob("*.mpk"):
            with open(path, "rb") as f:
                hello = next(iter(StreamReader(f)), None)
            if hello and hello.get("labels", {}).get("array_job_id") == array:
                found[hello["labels"]["array_task_id"]] = hello
        return found if len(found) == 3 else {}

    found = wait_for(tasks, 90, f"three tasks of array job {array} to be attached")
    assert sorted(found) == ["1", "2", "3"]
    for task, hello in found.items():
        job = hello["job"]
        wait_for(lambda: agent.ended(job), 60, f"task {task} (job {job}) to end and be let go")
        own = int((jobs / f"array-{task}.out").read_text().split("cpu_ns=")[1].split()[0])
        frames = agent.frames(job)
        seen = cpu(frames)
        assert abs(seen - own) <= 40e6 + 0.02 * own, str(dict(task=task, own=own, seen=seen,
                                                             **said(cluster, frames)))
        assert hello["labels"]["slurm_job_id"] == job


def test_a_job_that_fails_is_probed_and_let_go(site):
    cluster, agent, jobs = site
    job = cluster.sbatch("--chdir", str(jobs), "-o", str(jobs / "fails.out"), "-J", "fails", "--wrap",
                         burn_script(jobs, 1, after="exit 3"))
    wait_for(lambda: cluster.job_state(job) == "FAILED", 60, f"job {job} to fail")
    wait_for(lambda: agent.ended(job), 20, f"the agent to let job {job} go")
    # its batch script's exit code, from the kernel's exit record (the agent did not start it), whether the agent
    # saw its last process go or the epilog's detach came first
    end = agent.end(job)
    assert (end["cause"], end["exit_code"]) == ("exit", 3), end
    assert any(x.name == "jobprobe_job_end" and x.labels["job"] == job and x.labels["how"] == "exit 3"
               for x in agent.metrics())
    own = int((jobs / "fails.out").read_text().split("cpu_ns=")[1].split()[0])
    frames = agent.frames(job)
    assert abs(cpu(frames) - own) <= 40e6 + 0.02 * own, str(dict(own=own, seen=cpu(frames),
                                                                 **said(cluster, frames)))
    assert [rc for rc, _ in runs(cluster.base, "epilog", job)] == [0]


def test_a_job_cancelled_mid_run_is_let_go(site):
    cluster, agent, jobs = site
    job = cluster.sbatch("--chdir", str(jobs), "-o", "/dev/null", "-J", "long", "--wrap", burn_script(jobs, 120))
    wait_for(lambda: agent.attached(job), 30, f"job {job} to be attached")
    wait_for(lambda: cpu(agent.frames(job)) > 0.5e9, 30, f"job {job} to show CPU time")
    cluster.run("scancel", job)
    wait_for(lambda: cluster.job_state(job) == "CANCELLED", 30, f"job {job} to be cancelled")
    wait_for(lambda: not agent.attached(job), 30, f"the agent to let job {job} go")
    assert agent.ended(job) is not None
    end = agent.end(job)           # scancel: SIGTERM to the job's processes (SIGKILL after KillWait)
    assert end["cause"] == "signal" and end["signal"] in (15, 9), end
    assert [rc for rc, _ in runs(cluster.base, "epilog", job)] == [0]


def test_a_job_the_scheduler_requeues_ends_requeued(site):
    """`scontrol requeue` (what a preemption that requeues does too): SLURM stops the job and queues it again under
    the same id. Its processes die of SIGTERM, but the end is the scheduler's — its restart count grew."""
    cluster, agent, jobs = site
    job = cluster.sbatch("--requeue", "--chdir", str(jobs), "-o", "/dev/null", "-J", "requeued", "--wrap",
                         burn_script(jobs, 120))
    try:
        wait_for(lambda: agent.attached(job), 30, f"job {job} to be attached")
        wait_for(lambda: cpu(agent.frames(job)) > 0.3e9, 30, f"job {job} to show CPU time")
        cluster.run("scontrol", "requeue", job)
        wait_for(lambda: not agent.attached(job), 30, f"the agent to let job {job} go")
        end = agent.end(job)
        # SLURM's own word, independently: the job is pending again (once its epilog is done), restarted once
        wait_for(lambda: cluster.run("squeue", "-h", "-j", job, "-t", "all", "-O", "State:|,RestartCnt:|")
                 .stdout.split("|")[:2] == ["PENDING", "1"], 30, f"job {job} pending again, restarted once")
        assert end["cause"] == "requeued" and "restarts 1" in end["scheduler"] and end.get("signal") in (15, 9), end
        assert any(x.name == "jobprobe_job_end" and x.labels["job"] == job and x.labels["cause"] == "requeued" and
                   x.labels["failed"] == "true" for x in agent.metrics())
    finally:
        cluster.run("scancel", job, check=False)


# A job's name is its owner's to write: anything, fields of SLURM's text and a newline with a whole made-up squeue line
# included (SLURM prints it as it is). Its labels must be its own all the same, and it must be adopted.
HOSTILE_NAME = "while-down JobId=999 ArrayJobId=5 ArrayTaskId=3 UserId=mallory(7)\n1|mallory|debug|evil|fake"


def test_a_job_that_starts_while_the_agent_is_down_is_attached_when_it_comes_back(site):
    """...with its own labels, whatever its name says (HOSTILE_NAME: squeue's name column split the job's line in
    two, the job was not adopted and a made-up job 1 of mallory's was; scontrol's text gave it JobId 999 and array
    ids)."""
    cluster, agent, jobs = site
    agent.stop()
    try:
        job = cluster.sbatch("--chdir", str(jobs), "-o", "/dev/null", "-J", HOSTILE_NAME, "--wrap",
                             burn_script(jobs, 120))
        wait_for(lambda: cluster.job_state(job) == "RUNNING", 30, f"job {job} to run")
        wait_for(lambda: runs(cluster.base, "prolog", job), 10, "the prolog to have run")
        assert [rc for rc, _ in runs(cluster.base, "prolog", job)] == [0]   # no agent: said, and the job runs
        assert "jobprobe prolog:" in (cluster.base / "prolog.err").read_text()
        assert cluster.node_state() in ("allocated", "mixed"), cluster.node_state()   # not drained
    finally:
        agent.start()
    try:
        wait_for(lambda: agent.attached(job), 30, f"job {job} to be attached by the agent that came back")
        hello = agent.frames(job)[0]
        assert hello["from_start"] is False                # its start was missed: it counts from the attach
        assert (hello["labels"]["slurm_job_id"], hello["labels"]["partition"]) == (job, "debug"), hello["labels"]
        assert hello["labels"]["user"] == "root" and hello["labels"]["uid"] == "0", hello["labels"]
        assert hello["labels"]["job_name"] == HOSTILE_NAME and "array_job_id" not in hello["labels"], hello["labels"]
        assert [j["job"] for j in agent.status()["jobs"] + agent.status()["pending"]].count("1") == 0
    finally:
        cluster.run("scancel", job, check=False)
    wait_for(lambda: not agent.attached(job), 30, f"the agent to let job {job} go")


def test_an_array_of_many_short_jobs_each_attached_and_nothing_left_behind(site):
    """Every task of an array of short jobs is attached (its frames, its labels), let go, and the agent ends where
    it began: its fds, the programs it holds, no job attached or pending. JOBPROBE_ARRAY_TASKS=1000 makes this the
    thousand-job soak (docs/PERFORMANCE.md has its figures); CI runs 24."""
    from jobprobe.bench.agent import held_programs
    cluster, agent, jobs = site
    n = int(os.environ.get("JOBPROBE_ARRAY_TASKS", "24"))
    pid = agent.proc.pid
    fds0, progs0 = len(os.listdir(f"/proc/{pid}/fd")), held_programs(pid)
    array = cluster.sbatch(f"--array=1-{n}", "--chdir", str(jobs), "-o", "/dev/null", "-J", "many", "--wrap",
                           "sleep 1.5")

    def done() -> bool:
        res = cluster.run("squeue", "-h", "-j", array, check=False)
        return res.returncode == 0 and not res.stdout.strip()

    wait_for(done, 60 + 3 * n, f"the {n} tasks of array job {array} to finish")
    found = {}
    for path in agent.out.glob("*.mpk"):
        with open(path, "rb") as f:
            hello = next(iter(StreamReader(f)), None)
        if hello and hello.get("labels", {}).get("array_job_id") == array:
            found[hello["labels"]["array_task_id"]] = hello["job"]
    assert sorted(found, key=int) == [str(i) for i in range(1, n + 1)], sorted(found, key=int)
    wait_for(lambda: not any(j["job"] in found.values() for j in agent.status()["jobs"]), 30, "every task let go")
    st = agent.status()
    assert not st["pending"], st["pending"]
    assert len(os.listdir(f"/proc/{pid}/fd")) <= fds0 + 2 and held_programs(pid) == progs0
    for name in ("prolog", "epilog"):
        rcs = [rc for j in found.values() for rc, _ in runs(cluster.base, name, j)]
        assert rcs == [0] * n, (name, rcs)


def test_the_epilog_of_a_job_never_attached_says_so_and_exits_0(site):
    cluster, agent, _ = site
    res = subprocess.run([PYTHON, str(REPO / "scripts/slurm/epilog")], capture_output=True, text=True, timeout=30,
                         env={"PATH": os.environ.get("PATH", ""), "SLURM_JOB_ID": "999999",
                              "JOBPROBE_SOCKET": str(agent.sock)})
    assert res.returncode == 0 and res.stdout == ""
    assert res.stderr.strip() == "jobprobe epilog: job 999999: no job '999999' is attached " \
        f"(attached: {', '.join(j['job'] for j in agent.status()['jobs']) or 'none'})", res.stderr


def test_the_prolog_without_a_job_or_an_agent_says_so_and_exits_0(tmp_path):
    script = REPO / "scripts/slurm/prolog"
    for env, says in (({}, "not a job id"), ({"SLURM_JOB_ID": "7", "JOBPROBE_SOCKET": str(tmp_path / "none")},
                                                "FileNotFoundError")):
        res = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=30,
                             env={"PATH": os.environ.get("PATH", ""), **env})
        assert res.returncode == 0 and res.stdout == ""
        assert len(res.stderr.splitlines()) == 1 and says in res.stderr, res.stderr
