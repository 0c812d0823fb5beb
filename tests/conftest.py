# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Tiers: unit (no privilege), kernel (root: real BPF/perf on real cgroups), integration.

Kernel-tier tests are marked `kernel`; they skip only when not root, saying so. CI runs as root, so there they run.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from jobprobe.core.frame import FrameBuilder
from jobprobe.kernel.host import find_cgroup2_mount
from tests.workloads_memory import MemcgV1, memcg_v1_root, memwork

TESTS = Path(__file__).resolve().parent
IS_ROOT = os.geteuid() == 0
# a user without root's rights, who may still read the checkout wherever it lies (a clone in a 0700 directory):
# the capability to read and search any file, nothing else — no BPF, no perf, not uid 0
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=+dac_read_search",
             "--ambient-caps=+dac_read_search"]


def pytest_collection_modifyitems(config, items):
    long_first(items)
    skip_root = pytest.mark.skip(reason="needs root (real BPF, perf_event and cgroups); CI runs as root")
    for item in items:
        if "kernel" in item.keywords and not IS_ROOT:
            item.add_marker(skip_root)


# ---- two phases: tests that share the machine, then tests that need it to themselves -------------------------------
# scripts/test.sh runs the suite twice over: `-m "not serial"` on pytest-xdist workers, then `-m serial` alone. A test
# is `serial` when what it asserts is a share of the whole machine (a CPU hog beside the job, an overhead ratio, a
# time to detect) or it is CPU-bound for long: a neighbour would change its figure, not its correctness. Everything
# else must hold beside neighbours, which is itself a property the product promises (a node runs many jobs).
# Scheduling is by file (a module's fixtures load programs that another test of the same file may count); files that
# share one server at a fixed place (the SLURM cluster under /tmp/jobprobe-slurm) form one unit, run by one worker.
SHARED_UNITS = {"test_slurm.py": "slurm", "test_slurm_agent.py": "slurm"}
# The files in order of their time (`--durations=0`, summed per file over a 4-worker run: 122 s down to 10 s), the
# longest first, so that the workers finish together instead of one of them running a long file at the end alone (the
# image's root filesystem alone takes 65 s on a fresh machine; the SLURM unit is its two files). Order only: nothing
# is skipped.
LONG_FIRST = ("test_trace.py", "test_nats.py", "test_sched.py", "test_image.py", "test_slurm_agent.py", "test_slurm.py",
              "test_readme.py", "test_hostile.py", "test_cuda.py", "test_report.py", "test_install.py",
              "test_partitions.py",
              "test_agent.py", "test_cgroup.py", "test_auth.py", "test_demo.py", "test_blockio.py", "test_compact.py",
              "test_timeuse.py", "test_prometheus.py", "test_nic.py", "test_syscalls.py", "test_bpfcache.py",
              "test_cli.py", "test_perf.py", "test_bpf_loader.py", "test_net.py", "test_k8s_watch.py", "test_memory.py",
              "test_liveness.py")


def long_first(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(Path(str(it.fspath)).name, len(rank)))    # stable: in-file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_UNITS.get(Path(path).name, path)
    return ByFile(config, log)


# ---- the temp directory is left as it was found --------------------------------------------------------------------
# A run may leave no empty directory in the temp directory (what a host accumulates when every BPF load or bench
# run leaves one: hundreds a day). The entries there at the start are noted; at the end, a directory that is new and
# empty — still, after a short settle, so that another process's scratch directory of the moment is not counted —
# fails the session, named. pytest's own tmp_path directories (pytest-of-USER) are not empty: not counted.
TEMP_SETTLE_S = 0.5
_temp_start: set[str] | None = None
_temp_left: list[str] = []


def _temp_entries() -> set[str]:
    try:
        return set(os.listdir(tempfile.gettempdir()))
    except OSError:
        return set()


def _new_empty_dirs(before: set[str]) -> list[str]:
    root = tempfile.gettempdir()
    out = []
    for name in sorted(_temp_entries() - before):
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
                out.append(path)
        except OSError:
            continue                     # gone, or not ours to read: not a directory this run left
    return out


# ---- where the suite's CPU goes: JOBPROBE_TEST_CPU=FILE appends, per test, the CPU seconds of the worker and of the
# children it reaped during the test (its workloads, servers, CLI runs), and its wall seconds -----------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("JOBPROBE_TEST_CPU")
    if not out:
        yield
        return
    import resource

    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
    c0, t0 = cpu(), time.monotonic()
    yield
    with open(out, "a") as f:
        f.write(f"{cpu() - c0:.2f} {time.monotonic() - t0:.2f} {item.nodeid}\n")


def pytest_sessionstart(session):
    global _temp_start, _groups_start
    if not hasattr(session.config, "workerinput"):       # once per run (a pytest-xdist worker is not the run)
        _temp_start = _temp_entries()
        _groups_start = _test_groups()


# ---- and the cgroup tree too: every group a test or a bench made is gone, their parents with them ----------------
_groups_start: set[str] = set()
_groups_left: list[str] = []


def _test_groups() -> set[str]:
    """The groups under jobprobe-test/ and jobprobe-bench/ of the cgroup2 hierarchy, as paths."""
    mount = find_cgroup2_mount()
    out: set[str] = set()
    for parent in ("jobprobe-test", "jobprobe-bench"):
        root = Path(mount or "/nonexistent", parent)
        if root.is_dir():
            out |= {str(p) for p in root.iterdir() if p.is_dir()}
    return out


def _tidy_groups() -> list[str]:
    """The groups this run left (named), after the empty parents are removed."""
    left = sorted(_test_groups() - _groups_start)
    mount = find_cgroup2_mount()
    for parent in ("jobprobe-test", "jobprobe-bench"):
        try:
            Path(mount or "/nonexistent", parent).rmdir()      # only when empty: a group inside keeps it (EBUSY)
        except OSError:
            pass
    return left


def pytest_sessionfinish(session, exitstatus):
    if _temp_start is None or exitstatus == pytest.ExitCode.INTERRUPTED:
        return
    left = _new_empty_dirs(_temp_start)
    if left:
        time.sleep(TEMP_SETTLE_S)
        left = [p for p in _new_empty_dirs(_temp_start) if p in left]
    _temp_left[:] = left
    _groups_left[:] = _tidy_groups()
    if (left or _groups_left) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _temp_left:
        terminalreporter.write_sep("=", f"{len(_temp_left)} empty director{'y' if len(_temp_left) == 1 else 'ies'} "
                                        f"left in the temp directory by this run", red=True)
        for path in _temp_left:
            terminalreporter.write_line(f"left behind: {path}")
    if _groups_left:
        terminalreporter.write_sep("=", f"{len(_groups_left)} cgroup(s) left by this run", red=True)
        for path in _groups_left:
            terminalreporter.write_line(f"left behind: {path}")


class Cgroup:
    """A real cgroup2 group made for one test and removed after it."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)

    @property
    def id(self) -> int:
        return os.stat(self.path).st_ino

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        procs = self.path / "cgroup.procs"
        return subprocess.Popen(argv, preexec_fn=lambda: procs.write_text(str(os.getpid())), **kw)

    def cpu_usage_ns(self) -> int:
        return self.cpu_stat()["usage_usec"] * 1000

    def cpu_stat(self) -> dict[str, int]:
        out = {}
        for line in (self.path / "cpu.stat").read_text().splitlines():
            k, v = line.split()
            out[k] = int(v)
        return out

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        """The group and every group a test made inside it (deepest first), their processes killed."""
        if not self.path.exists():
            return
        dirs = sorted((Path(r) for r, _, _ in os.walk(self.path)), key=lambda p: len(p.parts), reverse=True)
        for d in dirs:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
        for d in dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


@pytest.fixture
def cgroup2_mount() -> str:
    mount = find_cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy mounted on this host")
    return mount


@pytest.fixture
def make_cgroup(cgroup2_mount, request):
    made: list[Cgroup] = []

    def make(name: str | None = None) -> Cgroup:
        name = name or f"{request.node.name[:40]}-{len(made)}".replace("[", "-").replace("]", "")
        cg = Cgroup(Path(cgroup2_mount, "jobprobe-test", f"{name}-{os.getpid()}"))
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.remove()


@pytest.fixture
def net():
    """Network namespaces A and B joined by a veth pair (tests/workloads_net.py), removed after the test."""
    from workloads_net import NetPair
    pair = NetPair()
    try:
        yield pair
    finally:
        pair.close()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_certs(d: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl) in `d`: ca.pem, server.pem, server.key;
    the CA's path."""
    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=jobprobe-test-ca")
    ssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return d / "ca.pem"


def until(cond, timeout: float, what: str, every: float = 0.05):
    """cond()'s first truthy value within `timeout` s; else AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for(what, timeout: float = 10.0):
    """what() until it is truthy, or its last value after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def prog_exists(prog_id: int) -> bool:
    """Whether the kernel still has a BPF program with this id."""
    from jobprobe.kernel import bpf as _bpf
    try:
        os.close(_bpf.prog_fd_by_id(prog_id))
    except FileNotFoundError:
        return False
    return True


def bpf_fds(kind: str = "prog") -> int:
    """Open fds of this process that are BPF programs ("prog"), maps ("map"), links ("link") or perf events
    ("perf": tracepoint and uprobe attachments) — what a probe's stop() must give back."""
    want = {"prog": "anon_inode:bpf-prog", "map": "anon_inode:bpf-map", "link": "anon_inode:bpf_link",
            "perf": "anon_inode:[perf_event]"}[kind]
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == want
        except OSError:
            pass  # the fd of the listing itself, already closed
    return n


def workload(name: str, *args) -> list[str]:
    """argv of a workload in tests/workloads.py (a plain Python process, the same interpreter)."""
    return [sys.executable, str(TESTS / "workloads.py"), name, *map(str, args)]


def steal_ns() -> int:
    """Hypervisor steal time of all CPUs so far (/proc/stat, 8th value of the cpuN lines), in ns."""
    ticks = sum(int(line.split()[8]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("cpu") and not line.startswith("cpu "))
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


# Upper bound of perf's task clock above the scheduler's CPU time per involuntary switch of the job (probes/perf.py's
# docstring: perf charges the few µs between a wakeup and the preemption it causes to the task preempted, the
# scheduler to the task woken; ~5.5 µs each for cgroup targets and ~3.7 µs for PID trees one day, 7.5 and 6.4
# another). Tests beside other tests' wakeups (phase 1) see thousands of such switches a second.
PREEMPT_SKEW_NS = {"cgroup": 7_500, "pids": 5_000}


# ---- another local user: what user `nobody` can do where the agent writes -----------------------------------------
needs_root_to_be_nobody = pytest.mark.skipif(not IS_ROOT, reason="needs root to act as user nobody (setuid); CI "
                                             "runs as root")


def as_nobody(where: Path, act) -> None:
    """act() in a forked child as user nobody, in directory `where` — entered as root first: a test's tmp_path lies
    under root's 0700 directories, which nobody cannot cross, so act() uses names relative to `where`. Fails the
    test if act() raised."""
    import pwd
    import traceback
    pw = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:                                    # pragma: no cover (the child)
        code = 1
        try:
            os.chdir(where)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            act()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "what user nobody did failed (its traceback is above)"


def nobody_uid() -> int:
    import pwd
    return pwd.getpwnam("nobody").pw_uid


# ---- memory: v1 memory groups with a limit, a cold file (test_memory, test_cgroup, test_pressure, test_ends) ----
@pytest.fixture
def make_memcg(request):
    """v1 memory cgroups with a limit (memory is a v1 controller on this project's hybrid hosts)."""
    root = memcg_v1_root()
    if root is None:
        pytest.skip("no cgroup v1 memory hierarchy (memory limits are tested where memory is a v1 controller)")
    groups = MemcgV1(root, f"jobprobe-test-{request.node.name[:30]}-{os.getpid()}")
    yield groups.make
    groups.remove()


@pytest.fixture
def cold_file():
    """A file on a disk filesystem (not tmpfs), written and dropped from the page cache by a workload."""
    made: list[Path] = []

    def make(mib: int) -> Path:
        made.append(Path(f"/var/tmp/jobprobe-memory-{os.getpid()}-{mib}.dat"))
        subprocess.run(memwork("mkfile", made[-1], mib), check=True)
        return made[-1]
    yield make
    for p in made:
        p.unlink(missing_ok=True)


# ---- helpers several test files share ----------------------------------------------------------------------------
# v1_cpu_group: test_cgroup, test_rules; sched_workload, account: test_sched, test_pressure; spawn: test_gpu,
# test_ncclras; samples: test_compact, test_argv.


def v1_cpu_group(name: str) -> Path | None:
    from jobprobe.kernel.host import find_cgroup_v1_mount
    m = find_cgroup_v1_mount("/proc/self/mountinfo", "cpu")
    if m is None:
        return None
    d = Path(m[0], "jobprobe-test", f"{name}-{os.getpid()}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def sched_workload(name: str, *args) -> list[str]:
    return [sys.executable, str(TESTS / "workloads_sched.py"), name, *map(str, args)]


def account(proc: subprocess.Popen, stdin: str | None = None) -> dict:
    """The workload's own JSON account (its last line of output)."""
    out, _ = proc.communicate(stdin, timeout=120)
    assert proc.returncode == 0
    return json.loads(out.splitlines()[-1])


@pytest.fixture
def spawn():
    procs = []

    def start(env=None, seconds=60):
        p = subprocess.Popen(["sleep", str(seconds)], env={**os.environ, **(env or {})})
        procs.append(p)
        # until it has exec'd, the child's /proc/PID/environ is its parent's (a busy host kept one there long
        # enough for the probe to read pytest's environment)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline, f"sleep (pid {p.pid}) did not exec in 30 s"
            time.sleep(0.001)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


SAMPLES_T0 = 1_790_000_000.0


def samples(node: str, job: str, n: int, start: float = SAMPLES_T0, seq0: int = 0, run: str = "r1") -> list[dict]:
    rnd = random.Random(hash((node, job, start)) & 0xffff)
    b = FrameBuilder(node, job, run=run)
    b.seq = seq0
    out = []
    for k in range(n):
        out.append(b.sample(start + k, 1.0, {
            "cgroup": {"cpu_user_ns": rnd.randrange(10 ** 8, 10 ** 9), "mem_bytes": 1 << 30},
            "sched": {"runq_lat_p99_us": rnd.uniform(1, 500),
                      "runq_lat_us_log2": [rnd.randrange(100) for _ in range(8)]},
            "net": {"top_peers": [{"addr": "10.0.0.2", "tx_bytes": rnd.randrange(1000)}], "source": "skb"},
            "gpu": {"util_pct": None}}, {"cgroup": "ok", "sched": "ok", "net": "ok", "gpu": "unavailable"}))
    return out


@contextlib.contextmanager
def serving_agent(cfg, persist: bool = False):
    """The node agent with `cfg`, its control socket served and its ticks running in a thread; stopped after (its
    jobs' last frames written, its programs released). test_agent, test_ends, test_prometheus, test_trace."""
    from jobprobe.node.agent import Agent
    from jobprobe.node.control import ControlServer
    agent = Agent(cfg)
    agent.persist = persist
    server = ControlServer(agent, cfg.socket)
    server.start()
    loop = threading.Thread(target=agent.run, daemon=True)
    loop.start()
    try:
        yield agent
    finally:
        agent.stop_event.set()
        loop.join(timeout=10)
        server.close()
        agent.close()
