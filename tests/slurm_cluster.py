# SPDX-License-Identifier: Apache-2.0
"""A real one-node SLURM cluster on loopback, started by the tests themselves (no systemd, no /etc/slurm).

munged, slurmctld and slurmd run as plain child processes in the foreground (-F / -D), so the test owns them and
stops them in order: the jobs (slurmstepd detaches from slurmd and would outlive it, retrying its controller), then
slurmd before slurmctld (../shared/MACHINE-FACTS.md), munged last (everything authenticates through it). All lives
under one fixed directory (short: UNIX socket paths must fit in 108 bytes), and a run that crashed is cleaned up by
the next one; client commands find the cluster through SLURM_CONF (see `env`).

Plugins: proctrack/linuxproc + task/none. The cgroup/v2 plugin refuses a hybrid v1+v2 host ("Hybrid mode is not
supported"); cgroup/v1 works (../shared/MACHINE-FACTS.md) but leaves /sys/fs/cgroup/<ctrl>/slurm_<node> trees
behind and puts nothing on cgroup2 either, and real clusters run cgroup/v2, whose job_<id> groups jobprobe finds in
the cgroup2 tree (tests/test_slurm.py covers that on fixture trees). With linuxproc the job's processes stay where
slurmd is (the cgroup2 root here), so `jobprobe --slurm-job` takes its PID-tree path through `scontrol listpids`.

Needs root and the Debian packages slurm-wlm, slurm-client and munge (scripts/setup.sh installs them).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol", "squeue", "scancel")
CGROUP_V1 = Path("/sys/fs/cgroup")


class SlurmError(RuntimeError):
    """The cluster did not come up (or a SLURM command failed); the message carries the daemons' log tails."""


def free_port(prefer: int) -> int:
    """`prefer` if nothing listens there on any address, else a port the kernel picks."""
    for port in (prefer, 0):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))  # slurmctld and slurmd bind the wildcard address
            except OSError:
                continue
            return s.getsockname()[1]
    raise SlurmError("no free TCP port")


class SlurmCluster:
    def __init__(self, base: str | Path | None = None, node: str | None = None, extra_conf: str = ""):
        tmp = tempfile.gettempdir()
        if len(tmp) > 40:  # munged's and slurmstepd's UNIX socket paths must fit in 108 bytes
            tmp = "/tmp"
        self.base = Path(base or Path(tmp, "jobprobe-slurm"))
        self.node = node or socket.gethostname().split(".")[0]  # SlurmctldHost must be `hostname -s`
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "munge.sock"
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock_fd: int | None = None
        self.extra_conf = extra_conf     # more slurm.conf lines (Prolog=, Epilog=, PrologFlags=)

    # ---- paths and environment ---------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF, for every client command (sbatch, scontrol, jobprobe's own scontrol)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def missing_binaries(self) -> list[str]:
        return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]

    # ---- start -------------------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "SlurmCluster":
        missing = self.missing_binaries()
        if missing:
            raise SlurmError(f"SLURM not installed (missing {', '.join(missing)}): run scripts/setup.sh")
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)  # slurmstepd and munged check the path; jobs run as root anyway
        # One cluster per base dir at a time (ports, pid files); a second run waits for the first.
        self._lock_fd = os.open(self.base / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            self._clean_leftovers()
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _sbin(self, name: str) -> str:
        return shutil.which(name) or str(Path("/usr/sbin", name))

    def _clean_leftovers(self) -> None:
        """A previous run that crashed may have left daemons (pid files here), jobs and state. Stop them, and only
        them: a job process or slurmstepd carries this directory's SLURM_CONF, a daemon's command line names this
        directory. Jobs first (killed: nothing to save), then slurmd, slurmctld, munged in that order (each waits
        on the next one at shutdown). Then wipe state and spool."""
        for pid in self._job_processes():
            self._kill(pid, grace=0)
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.base / f"{name}.pid"
            try:
                pid = int(pidfile.read_text().split()[0])
                if str(self.base).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    self._kill(pid)
            except (OSError, ValueError, IndexError):
                pass
            pidfile.unlink(missing_ok=True)
        for d in ("state", "spool", "munge"):
            shutil.rmtree(self.base / d, ignore_errors=True)
        for f in ("munge.sock", "munge.sock.lock"):
            (self.base / f).unlink(missing_ok=True)
        self._remove_cgroup_dirs()

    @staticmethod
    def _kill(pid: int, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (at once if grace is 0). A zombie counts as gone."""
        def alive() -> bool:
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
            except OSError:
                return False

        if grace > 0:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            end = time.monotonic() + grace
            while time.monotonic() < end and alive():
                time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _start_munge(self) -> None:
        mdir = self.base / "munge"
        mdir.mkdir(mode=0o700)
        key = mdir / "munge.key"
        # munged wants the key owned by its user and readable by nobody else.
        fd = os.open(key, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        # -F: stay our child; --force: take over a socket a crashed run left behind (we also remove it first)
        self._spawn("munged", [
            self._sbin("munged"), "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.base / 'munged.pid'}", f"--log-file={self.base / 'munged.log'}",
            f"--seed-file={mdir / 'munged.seed'}", "--num-threads=2"])
        self._wait(lambda: self.munge_socket.exists(), 10, "munged did not create its socket")

    def _write_conf(self) -> None:
        for d in ("state", "spool"):
            (self.base / d).mkdir(mode=0o755)
        ctld_port = free_port(6817)
        slurmd_port = free_port(6818)
        if slurmd_port == ctld_port:
            slurmd_port = free_port(0)
        b = self.base
        conf = f"""\
# written by tests/slurm_cluster.py for one test run
ClusterName=jobprobe
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/slurmctld.log
SlurmdLogFile={b}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
# start a batch job at submit time, not on the next scheduling pass (default: up to 3 s later)
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# keep finished jobs in slurmctld's memory for a while, so their state can still be asked for
MinJobAge=300
KillWait=2
InactiveLimit=0
SlurmdTimeout=300
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf + self.extra_conf)

    def _spawn(self, name: str, argv: list[str]) -> None:
        argv = [self._sbin(argv[0]) if not os.path.isabs(argv[0]) else argv[0], *argv[1:]]
        out = open(self.base / f"{name}.out", "wb")
        with out:
            # own session: a ^C at the test's terminal must not reach the daemons before stop() does
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                env=self.env, start_new_session=True)

    def _wait(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with code {p.returncode}\n{self.logs()}")
            time.sleep(0.05)
        raise SlurmError(f"{what} within {timeout} s\n{self.logs()}")

    def wait_idle(self, timeout: float = 30.0) -> None:
        self._wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} did not become idle")

    def node_state(self) -> str:
        res = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False)
        # one line per partition the node is in: the same state on each
        return (res.stdout.split() or [""])[0] if res.returncode == 0 else ""

    def logs(self, lines: int = 15) -> str:
        out = []
        for name in ("munged.log", "munged.out", "slurmctld.log", "slurmctld.out", "slurmd.log", "slurmd.out"):
            try:
                tail = (self.base / name).read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if tail:
                out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- client commands ---------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
        res = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}\n{self.logs()}")
        return res

    def sbatch(self, *args: str) -> str:
        """Submit a batch job; returns its id."""
        res = self.run("sbatch", "--parsable", *args)
        return res.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, COMPLETED, … ('' once slurmctld has forgotten the job)."""
        res = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        for item in res.stdout.split():
            if item.startswith("JobState="):
                return item.split("=", 1)[1]
        return ""

    def listpids(self, job_id: str) -> list[int]:
        res = self.run("scontrol", "listpids", job_id, check=False)
        return [int(ln.split()[0]) for ln in res.stdout.splitlines()[1:] if ln.split() and ln.split()[0].isdigit()]

    # ---- stop --------------------------------------------------------------------------------------------
    def _job_processes(self) -> list[int]:
        """slurmstepd processes and job processes of this cluster, found by the SLURM_CONF slurmd passed on to them
        (slurmstepd detaches from slurmd and outlives it; its command line is just "slurmstepd: [1.batch]")."""
        mark = f"SLURM_CONF={self.conf}".encode()
        me = os.getpid()
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == me:
                continue
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            if mark in env and (comm.startswith("slurmstepd") or any(e.startswith(b"SLURM_JOB_ID=") for e in env)):
                found.append(int(d.name))
        return found

    def cancel_all(self, timeout: float = 15.0) -> None:
        """Cancel every job and wait until their slurmstepds have exited (they need slurmd and slurmctld for that)."""
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        self.run("scancel", "--partition=debug", check=False)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            res = self.run("squeue", "-h", "-o", "%i", check=False)
            if res.returncode == 0 and not res.stdout.strip() and not self._job_processes():
                return
            time.sleep(0.1)

    def stop(self) -> None:
        """Idempotent; in the order the module doc gives."""
        try:
            self.cancel_all()
        except (OSError, subprocess.SubprocessError):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        for pid in self._job_processes():  # only if cancelling did not finish in time
            self._kill(pid, grace=1.0)
        for pidfile in self.base.glob("*.pid"):
            pidfile.unlink(missing_ok=True)
        self._remove_cgroup_dirs()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _remove_cgroup_dirs(self) -> None:
        """With the cgroup/v1 plugins slurmd leaves /sys/fs/cgroup/<ctrl>/slurm_<node> trees behind (linuxproc,
        used here, makes none; a run with another configuration may have). Empty cgroup v1 dirs go with rmdir,
        deepest first; a group still in use stays."""
        if not CGROUP_V1.is_dir():
            return
        for ctrl in CGROUP_V1.iterdir():
            top = ctrl / f"slurm_{self.node}"
            if not top.is_dir():
                continue
            for root, dirs, _ in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
                try:
                    os.rmdir(root)
                except OSError:
                    pass

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
