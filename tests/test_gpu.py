# SPDX-License-Identifier: Apache-2.0
"""gpu probe. Unit tier: the REAL pynvml binding against a fake libnvidia-ml.so.1 compiled from
tests/fake_nvml/fake_nvml.c, whose values (and faults) each test writes; real processes, real /proc. In this process
the fake is preloaded by absolute path, so pynvml's own CDLL("libnvidia-ml.so.1") gets it (same soname); the CLI
tests run a subprocess with LD_LIBRARY_PATH pointing at it. The `gpu` test runs against a real GPU and driver.
"""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IS_ROOT
from fake_nvml.spies import Frames, Spy
from fake_nvml.state import HERE as FAKE_DIR
from fake_nvml.state import FakeState, build
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.devices.gpuowner import allowed_gpu_minors, parse_visible
from jobprobe.devices.nvmltypes import decode_reasons
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel.host import Host
from jobprobe.node.sampler import Sampler
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.gpu import NO_DRIVER, GpuProbe
from tests.devcg_progs import DEV_CHAR, allow_list, attach_device_program

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
UUID = ["GPU-8f6e2b1c-0000-4000-8000-00000000aaaa", "GPU-8f6e2b1c-0000-4000-8000-00000000bbbb"]
TRUTH = [dict(uuid=UUID[0], name="NVIDIA H100 80GB HBM3", util="55 33", mem=f"{80 * GiB} {10 * GiB}",
              clocks="1980 2619", max_sm_clock=2200, power=312000, energy=5_000_000, temp=64, pcie="1000 2000",
              throttle="0x24", ecc="3 1", remap="2 0 1 0", nvlink_tx="100 200", nvlink_rx="5 6", gpm=1,
              gpm_values="2=45.5 3=30.25 5=12.0 10=60.0"),
         dict(uuid=UUID[1], name="NVIDIA H100 80GB HBM3", util="7 2", mem=f"{80 * GiB} {GiB}", clocks="345 2619",
              max_sm_clock=1980,
              power=70000, energy=9_000_000, temp=31, pcie="0 0", throttle="0x1", ecc="0 0", remap="0 0 0 0",
              gpm=0)]


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fake_nvml"))


@pytest.fixture(scope="session")
def nvml(fake_lib):
    """pynvml, bound to the fake: loaded here by path, found by pynvml under its soname."""
    import pynvml
    if pynvml.nvmlLib is not None and not hasattr(pynvml.nvmlLib, "fake_nvml_is_fake"):
        pytest.fail("pynvml already holds a real libnvidia-ml in this process")
    ctypes.CDLL(str(fake_lib), mode=ctypes.RTLD_GLOBAL)
    pynvml.nvmlInit()
    assert hasattr(pynvml.nvmlLib, "fake_nvml_is_fake"), "pynvml did not load the fake"
    pynvml.nvmlShutdown()
    return pynvml


@pytest.fixture
def fake(nvml, tmp_path, monkeypatch):
    st = FakeState(tmp_path / "state", tmp_path / "calls.log")
    for i, truth in enumerate(TRUTH):
        st.gpu(i, **truth)
    monkeypatch.setenv("FAKE_NVML_STATE", str(st.path))   # putenv: the C library's getenv sees it
    monkeypatch.setenv("FAKE_NVML_LOG", str(st.log))
    return st.write()


@pytest.fixture
def probes():
    made = []

    def make(target, host=None, nvml=None):
        p = GpuProbe(host or Host(), nvml=nvml)
        p.start(target)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()


def test_parsers():
    class G:
        def __init__(self, i):
            self.index, self.uuid = i, UUID[i] if i < 2 else f"GPU-ffff{i}"
    gpus = [G(0), G(1), G(2)]
    assert parse_visible("1", gpus, gpus) == {1}
    assert parse_visible("0,2", gpus, [gpus[1], gpus[2]]) == {1}        # indices count within what it can see
    assert parse_visible("GPU-8f6e2b1c-0000-4000-8000-00000000b", gpus, []) == {1}   # a unique UUID prefix
    assert parse_visible("2,7,0", gpus, gpus) == {2}                   # CUDA: an invalid entry ends the list
    assert parse_visible("all", gpus, gpus) == {0, 1, 2} and parse_visible("none", gpus, gpus) == set()
    assert parse_visible("MIG-1234,1", gpus, gpus) == {1}
    assert allowed_gpu_minors("c 195:3 rw\nc 195:255 rw\nc 136:* rw\n") == {3}
    assert allowed_gpu_minors("a *:* rwm\n") is None and allowed_gpu_minors("c 195:* rwm\n") is None
    assert decode_reasons(0x24) == ["sw_power_cap", "sw_thermal_slowdown"] and decode_reasons(1 << 40) == ["bit40"]


def test_values_equal_the_fakes_ground_truth(fake, spawn, probes):
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{3 * GiB}").write()
    probe = probes(PidTreeTarget([job.pid]))
    fake.gpu(0, energy=5_000_000 + 312_000, ecc="5 1", nvlink_tx="150 260", nvlink_rx="5 9").write()
    out = probe.sample()
    assert out["ngpus"] == 1 and out["node_gpus"] == 2 and "note" not in out
    g = out["gpus"][0]
    assert g == {
        "index": 0, "uuid": UUID[0], "name": "NVIDIA H100 80GB HBM3", "rule": "process", "lost": False,
        "util_gpu_pct": 55, "util_mem_pct": 33, "mem_used_bytes": 10 * GiB, "mem_total_bytes": 80 * GiB,
        "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_mw": 312000, "temp_c": 64,
        "pcie_tx_bytes_per_s": 1000 * 1024, "pcie_rx_bytes_per_s": 2000 * 1024,
        "clock_event_reasons": 0x24, "clock_event_names": ["sw_power_cap", "sw_thermal_slowdown"],
        "remapped_rows_corrected": 2, "remapped_rows_uncorrected": 0, "remap_pending": True, "remap_failure": False,
        "energy_mj": 312_000, "ecc_corrected": 2, "ecc_uncorrected": 0,
        "nvlink_tx_bytes": (50 + 60) * 1024, "nvlink_rx_bytes": 3 * 1024,
        "gpm_sm_active_pct": 45.5, "gpm_sm_occupancy_pct": 30.25, "gpm_tensor_active_pct": 12.0,
        "gpm_dram_bw_pct": 60.0, "ofu_pct": 10.8, "xid_errors": 0, "shared": False, "job_procs": 1, "other_procs": 0,
        "job_mem_bytes": 3 * GiB, "procs": [{"pid": job.pid, "mem_bytes": 3 * GiB}], "sharing": "exclusive",
        "job_mem_share": 0.3, "job_sm_pct": 0, "job_mem_util_pct": 0, "job_enc_pct": 0, "job_dec_pct": 0,
        "others_sm_pct": 0, "util_samples": 0, "util_source": "ProcessesUtilizationInfo", "accounting": False,
        "job_energy_mj": 312_000, "energy_split": "exclusive"}
    assert set(g) | {"gpus", "ngpus", "node_gpus", "note", "unsupported", "exited"} == \
        {k.removeprefix("gpus[].") for k in GpuProbe.fields if not k.startswith("gpus[].mig")}, \
        "every declared field, and only those (MIG: test_mig_devices_of_two_jobs)"
    fake.gpu(0, energy=5_000_000 + 312_000 + 1000, util="90 80").write()
    out = probe.sample()
    g = out["gpus"][0]
    assert (g["energy_mj"], g["util_gpu_pct"], g["ecc_corrected"], g["nvlink_tx_bytes"]) == (1000, 90, 0, 0)


def test_ofu_is_tensor_activity_at_the_clock_it_ran_over_the_clocks_maximum(fake, spawn, probes):
    """OFU (arXiv 2605.20799): the same tensor activity at half the SM clock is half the FLOPs. Without GPM (GPU 1)
    or without the clock's maximum (a driver that will not say), no OFU — never a guess."""
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{GiB}").gpu(1, procs=f"{job.pid}:{GiB}").write()
    probe = probes(PidTreeTarget([job.pid]))
    fake.gpu(0, clocks="990 2619", gpm_values="2=80 3=50 5=60.0 10=20").write()
    g0, g1 = probe.sample()["gpus"]
    assert (g0["gpm_tensor_active_pct"], g0["sm_clock_mhz"], g0["ofu_pct"]) == (60.0, 990, 27.0)
    assert "ofu_pct" not in g1 and "gpm_tensor_active_pct" not in g1
    fake.gpu(0, max_sm_clock=0).write()            # asked once, at the start: the maximum stays known
    assert probe.sample()["gpus"][0]["ofu_pct"] == 27.0
    fresh = probes(PidTreeTarget([job.pid]))         # a new session finds no maximum: no OFU
    fresh.sample()
    assert "ofu_pct" not in fresh.sample()["gpus"][0]


def test_nvlink_summed_per_link_where_the_driver_refuses_the_aggregate(fake, spawn, probes):
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{GiB}", nvlink_no_aggregate=1).write()
    probe = probes(PidTreeTarget([job.pid]))
    fake.gpu(0, nvlink_tx="101 207", nvlink_rx="15 6").write()
    g = probe.sample()["gpus"][0]
    assert (g["nvlink_tx_bytes"], g["nvlink_rx_bytes"]) == (8 * 1024, 10 * 1024)


@pytest.mark.kernel
def test_rule_process_real_cgroup2_group_and_shared(fake, spawn, probes, make_cgroup):
    cg = make_cgroup()
    job = cg.spawn(["sleep", "60"])
    outsider = spawn()
    try:
        fake.gpu(1, procs=f"{outsider.pid}:{GiB} {job.pid}:{2 * GiB}").write()
        out = probes(CgroupTarget(str(cg.path))).sample()
        g = out["gpus"][0]
        assert [x["index"] for x in out["gpus"]] == [1]
        assert (g["rule"], g["shared"], g["job_procs"], g["other_procs"], g["job_mem_bytes"]) == \
            ("process", True, 1, 1, 2 * GiB)
    finally:
        job.kill()
        job.wait()


def test_shared_gpu_two_jobs_each_get_their_own_memory(fake, spawn, probes):
    a, b = spawn(), spawn()
    fake.gpu(0, procs=f"{a.pid}:{GiB} {b.pid}:{5 * GiB}", gprocs=f"{a.pid}:{GiB}").write()
    ga = probes(PidTreeTarget([a.pid])).sample()["gpus"][0]
    gb = probes(PidTreeTarget([b.pid])).sample()["gpus"][0]
    assert (ga["job_mem_bytes"], ga["shared"], ga["other_procs"], ga["procs"]) == \
        (GiB, True, 1, [{"pid": a.pid, "mem_bytes": GiB}])     # on both lists: counted once
    assert (gb["job_mem_bytes"], gb["shared"], gb["job_procs"]) == (5 * GiB, True, 1)


@pytest.mark.parametrize("env,want", [
    ({"CUDA_VISIBLE_DEVICES": "1"}, [1]),
    ({"CUDA_VISIBLE_DEVICES": UUID[0][:-2]}, [0]),                  # a unique UUID prefix, as CUDA accepts
    ({"CUDA_VISIBLE_DEVICES": UUID[0][:20]}, []),                   # one both UUIDs share: names nothing
    ({"NVIDIA_VISIBLE_DEVICES": UUID[1]}, [1]),
    ({"NVIDIA_VISIBLE_DEVICES": f"{UUID[1]}", "CUDA_VISIBLE_DEVICES": "0"}, [1]),   # 0 of what the container sees
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
])
def test_rule_env_in_a_real_process(fake, spawn, probes, env, want):
    job = spawn(env)
    out = probes(PidTreeTarget([job.pid])).sample()
    assert [g["index"] for g in out["gpus"]] == want
    assert all(g["rule"] == "env" and g["shared"] is False and g["job_procs"] == 0 for g in out["gpus"])


def test_rule_device_cgroup_on_a_fixture_tree(fake, tmp_path, probes):
    """A v1 devices hierarchy (as SLURM's ConstrainDevices makes): the job may open /dev/nvidia5, GPU 1's minor."""
    fake.gpu(1, minor=5).write()
    proc, devs = tmp_path / "proc", tmp_path / "sys/fs/cgroup/devices"
    pid = 4242
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (python) S 1 " + "0 " * 40 + "\n")
    (proc / str(pid) / "cgroup").write_text("12:devices:/slurm/uid_0/job_7/step_0\n11:cpu,cpuacct:/slurm\n0::/\n")
    (proc / str(pid) / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0HOME=/root\0")
    step = devs / "slurm/uid_0/job_7/step_0"
    step.mkdir(parents=True)
    (step / "devices.list").write_text("c 195:5 rw\nc 195:255 rw\nc 1:3 rwm\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 25 0:26 / {devs} rw,nosuid - cgroup cgroup rw,devices\n")
    host = Host(proc=str(proc), mountinfo=str(mountinfo))
    probe = probes(PidTreeTarget([pid], proc=str(proc)), host=host)
    out = probe.sample()
    # CUDA_VISIBLE_DEVICES=0 is the first GPU it can see, GPU 1, not NVML's GPU 0: the cgroup rule wins anyway
    assert [(g["index"], g["rule"]) for g in out["gpus"]] == [(1, "devices")]
    (step / "devices.list").write_text("a *:* rwm\n")     # unrestricted: now the env index counts from NVML's 0
    assert [(g["index"], g["rule"]) for g in probe.sample()["gpus"]] == [(0, "env")]


@pytest.mark.kernel
def test_rule_device_programs_on_a_real_cgroup2_group(fake, make_cgroup, probes):
    """GPUs from the fake NVML (tests/fake_nvml, a fake: this machine has no GPU) with minors 4 and 5; the job's
    group may open only 195:5 (GPU 1) and nvidiactl, as a container runtime or SLURM on cgroup v2 sets it up."""
    fake.gpu(0, minor=4).gpu(1, minor=5).write()
    cg = make_cgroup()
    job = cg.spawn(["sleep", "60"], env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    fds = attach_device_program(allow_list([(DEV_CHAR, 195, 5, 6), (DEV_CHAR, 195, 255, 6), (DEV_CHAR, 1, None, 7)]),
                                str(cg.path))
    try:
        probe = probes(CgroupTarget(str(cg.path)))
        out = probe.sample()
        # CUDA_VISIBLE_DEVICES=0 is the first GPU it can see, GPU 1, not NVML's GPU 0: the device rule wins anyway
        assert [(g["index"], g["rule"]) for g in out["gpus"]] == [(1, "devices")]
        _bpf.close_all(fds)
        fds = []
        # no device program now: the env index counts from NVML's 0
        assert [(g["index"], g["rule"]) for g in probe.sample()["gpus"]] == [(0, "env")]
    finally:
        _bpf.close_all(fds)
        job.kill()
        job.wait()


MIG = ["MIG-11111111-2222-5333-8444-555555555555", "MIG-11111111-2222-5333-8444-666666666666",
       "MIG-11111111-2222-5333-8444-777777777777"]


def test_mig_devices_of_two_jobs(fake, spawn, probes):
    """GPU 0 in MIG mode with three MIG devices: one job runs on slot 2 (its process list), another names slot 5 in
    CUDA_VISIBLE_DEVICES; each gets GPU 0 with its own MIG device, memory, processes and its GPU instance's GPM
    metrics (nvmlGpmMigSampleGet). GPU 1 is not in MIG mode."""
    a = spawn()
    b = spawn({"CUDA_VISIBLE_DEVICES": MIG[2][:-4]})        # a unique prefix, as CUDA accepts
    other = spawn()
    fake.mig(0, 0, MIG[0], 1, 0, 10 * GiB, 2 * GiB, procs=f"{other.pid}:{2 * GiB}")
    fake.mig(0, 2, MIG[1], 2, 0, 20 * GiB, 6 * GiB, procs=f"{a.pid}:{5 * GiB} {other.pid}:{GiB}",
             gpm="2=11.5 3=22.0 5=0.5 10=33.25")                 # its GPU instance's GPM (GPU 0 has GPM)
    fake.mig(0, 5, MIG[2], 9, 1, 10 * GiB, 0).write()
    fake.gpu(0, procs=f"{other.pid}:{3 * GiB} {a.pid}:{5 * GiB}").write()   # the whole GPU's list: all instances
    ga = probes(PidTreeTarget([a.pid])).sample()["gpus"]
    outb = probes(PidTreeTarget([b.pid])).sample()
    gb = outb["gpus"]
    assert [(g["index"], g["rule"]) for g in ga] == [(0, "process")]
    assert ga[0]["mig"] == [{"slot": 2, "uuid": MIG[1], "gpu_instance": 2, "compute_instance": 0, "rule": "process",
                             "mem_used_bytes": 6 * GiB, "mem_total_bytes": 20 * GiB, "shared": True, "job_procs": 1,
                             "other_procs": 1, "job_mem_bytes": 5 * GiB,
                             "procs": [{"pid": a.pid, "mem_bytes": 5 * GiB}], "gpm_sm_active_pct": 11.5,
                             "gpm_sm_occupancy_pct": 22.0, "gpm_tensor_active_pct": 0.5, "gpm_dram_bw_pct": 33.25}]
    assert ga[0]["gpm_sm_active_pct"] == 45.5                             # the whole GPU's GPM is its own
    assert ga[0]["power_mw"] == 312000 and ga[0]["shared"] is True          # the whole GPU's values
    assert ga[0]["sharing"] == gb[0]["sharing"] == "mig"
    assert [(g["index"], g["rule"]) for g in gb] == [(0, "env")]
    assert [(m["slot"], m["rule"], m["job_procs"], m["shared"]) for m in gb[0]["mig"]] == [(5, "env", 0, False)]
    # slot 5's instance has no GPM values in the fake: its metrics are unsupported there, once; the GPU's still come
    assert "gpm_sm_active_pct" not in gb[0]["mig"][0] and gb[0]["gpm_sm_active_pct"] == 45.5
    assert "gpu0.mig5.gpm_sm_active_pct" in outb["unsupported"]
    assert set(ga[0]["mig"][0]) == {k.removeprefix("gpus[].mig[].") for k in GpuProbe.fields
                                    if k.startswith("gpus[].mig[].")}
    # the older form names a MIG device by its GPU's UUID and instance ids
    c = spawn({"NVIDIA_VISIBLE_DEVICES": f"MIG-{UUID[0]}/1/0"})
    gc = probes(PidTreeTarget([c.pid])).sample()["gpus"]
    assert [(g["index"], [m["slot"] for m in g["mig"]]) for g in gc] == [(0, [0])]
    # GPU 1 is not in MIG mode: no "mig" key
    d = spawn({"CUDA_VISIBLE_DEVICES": UUID[1]})
    assert "mig" not in probes(PidTreeTarget([d.pid])).sample()["gpus"][0]


def test_no_gpu_for_the_job_then_opened_later(fake, spawn, probes):
    job = spawn()
    probe = probes(PidTreeTarget([job.pid]))
    out = probe.sample()
    assert out["gpus"] == [] and out["ngpus"] == 0 and "uses none of the node's 2 GPUs" in out["note"]
    fake.gpu(1, procs=f"{job.pid}:{GiB}").write()
    out = probe.sample()
    g = out["gpus"][0]
    assert g["index"] == 1 and g["rule"] == "process" and g["util_gpu_pct"] == 7 and "note" not in out
    assert "energy_mj" not in g      # it joined this tick: deltas start next tick, from a baseline taken now
    assert out["unsupported"] == ["gpu1.nvlink", "gpu1.gpm"]   # this GPU has neither: found when it joined
    fake.gpu(1, energy=9_000_000 + 4242).write()
    g = probe.sample()["gpus"][0]
    assert g["energy_mj"] == 4242 and not any(k.startswith("gpm_") for k in g)


def test_node_without_gpus(fake, spawn, probes):
    fake.count = 0
    fake.gpus.clear()
    fake.write()
    out = probes(PidTreeTarget([spawn().pid])).sample()
    assert out["gpus"] == [] and out["node_gpus"] == 0 and out["note"] == "this node has no NVIDIA GPU"


def test_unsupported_is_reported_once_and_never_asked_again(fake, nvml, spawn, probes):
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{GiB}", unsupported="nvmlDeviceGetPowerUsage nvmlDeviceGetRemappedRows").write()
    spy = Spy(nvml)
    probe = probes(PidTreeTarget([job.pid]), nvml=spy)
    outs = [probe.sample() for _ in range(4)]
    assert set(outs[0]["unsupported"]) == {"gpu0.power", "gpu0.remapped_rows", "mps_processes"}
    assert all("unsupported" not in o for o in outs[1:])
    assert all("power_mw" not in o["gpus"][0] and "remapped_rows_corrected" not in o["gpus"][0] for o in outs)
    assert fake.calls("nvmlDeviceGetPowerUsage", 0) == 1 and fake.calls("nvmlDeviceGetRemappedRows", 0) == 1
    # Functions this driver lacks (NVMLError_FunctionNotFound): asked once; the older name takes over if there is one
    assert spy.counts["nvmlDeviceGetMPSComputeRunningProcesses_v3"] == 1
    assert spy.counts["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert spy.counts["nvmlDeviceGetCurrentClocksThrottleReasons"] == 4
    assert all(o["gpus"][0]["clock_event_reasons"] == 0x24 for o in outs)


def test_gpu_lost_mid_run(fake, spawn, probes):
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{GiB}").gpu(1, procs=f"{job.pid}:{GiB}").write()
    probe = probes(PidTreeTarget([job.pid]))
    assert [g["lost"] for g in probe.sample()["gpus"]] == [False, False]
    fake.gpu(1, lost=1).write()
    out = probe.sample()
    assert out["gpus"][1] == {"index": 1, "uuid": UUID[1], "name": "NVIDIA H100 80GB HBM3", "rule": "process",
                              "lost": True}
    assert out["_events"] == [{"event": "gpu_lost", "gpu": 1, "uuid": UUID[1]}]
    calls = fake.log.read_text().count(" 1\n")
    out = probe.sample()
    assert out["gpus"][0]["util_gpu_pct"] == 55 and out["gpus"][1]["lost"] and "_events" not in out
    assert fake.log.read_text().count(" 1\n") == calls, "a lost GPU is not asked again"


def test_gpu_lost_before_start(fake, spawn, probes):
    fake.gpu(1, lost=1).write()
    out = probes(PidTreeTarget([spawn({"CUDA_VISIBLE_DEVICES": "0,1"}).pid])).sample()
    assert [(g["index"], g["lost"]) for g in out["gpus"]] == [(0, False), (1, True)]
    assert out["_events"] == [{"event": "gpu_lost", "gpu": 1, "uuid": None}]


def test_xid_becomes_an_event_frame(fake, spawn):
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{GiB}", xids="13").write()   # before we registered: not ours to report
    out = Frames()
    sampler = Sampler(PidTreeTarget([job.pid]), [GpuProbe(Host())], [out])
    sampler.start()
    try:
        fake.gpu(0, xids="13 79 48").gpu(1, xids="31").write()   # GPU 1 is not the job's
        sampler.tick()
    finally:
        sampler.stop()
    assert out[0]["probes"]["gpu"] == "ok" and out[1]["probes"]["gpu"]["gpus"][0]["xid_errors"] == 2
    events = [(f["event"], f["probe"], f["gpu"], f["xid"]) for f in out if f["kind"] == "event"]
    assert events == [("gpu_xid", "gpu", 0, 79), ("gpu_xid", "gpu", 0, 48)]


def fake_env(fake_lib, state):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML")}
    return {**env, "LD_LIBRARY_PATH": str(fake_lib.parent), "FAKE_NVML_STATE": str(state),
            "PYTHONPATH": str(ROOT)}


@pytest.mark.skipif(not IS_ROOT, reason="needs root: `-- CMD` creates a cgroup2 group")
def test_cli_end_to_end_with_the_fake_on_ld_library_path(fake, fake_lib):
    """A real subprocess: pynvml finds the fake by LD_LIBRARY_PATH; the job puts itself on GPU 0's process list
    and writes per-process samples of itself."""
    job = [sys.executable, str(FAKE_DIR / "gpu_job.py"), "0", str(7 * GiB), "2.5", "37"]
    other = subprocess.Popen(["sleep", "60"])        # another job's process on the same GPU: a shared GPU
    fake.gpu(0, procs=f"{other.pid}:{GiB}").write()
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,gpu", "--stdout", "json",
                          "--interval", "0.5", "--", *job], env={**fake_env(fake_lib, fake.path),
                                                                 "FAKE_OTHER": f"{other.pid}:18"},
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    other.kill()
    other.wait()
    assert res.returncode == 0, res.stderr
    frames = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    pid = int(next(ln for ln in res.stdout.splitlines() if ln.startswith("gpu_job")).split()[1])
    assert frames[0]["probes"] == {"cgroup": "ok", "gpu": "ok"}
    ticks = [f["probes"]["gpu"] for f in frames if f["kind"] == "sample"]
    on = [t["gpus"][0] for t in ticks if t["gpus"]]
    assert len(ticks) >= 4 and len(on) >= 3, ticks
    for g in on:
        assert (g["index"], g["uuid"], g["rule"], g["util_gpu_pct"], g["mem_used_bytes"], g["power_mw"]) == \
            (0, UUID[0], "process", 55, 10 * GiB, 312000)
        assert g["procs"] == [{"pid": pid, "mem_bytes": 7 * GiB}] and g["job_mem_bytes"] == 7 * GiB
        assert g["shared"] is True and g["sharing"] == "time-slicing"
    assert all(g["energy_mj"] == 0 for g in on[1:])   # the fake's counter stands still
    # the job's own share beside the device's: the samples the job wrote of itself (37%), the other process's (18%)
    sampled = [g for g in on if g.get("util_samples")]
    assert len(sampled) >= 2 and all((g["job_sm_pct"], g["others_sm_pct"], g["util_gpu_pct"]) == (37, 18, 55)
                                     for g in sampled), on


@pytest.mark.parametrize("code,why", [(9, "NVIDIA driver not loaded"), (999, "nvmlInit failed: Unknown Error")])
def test_init_errors_say_why(nvml, code, why):
    class NoInit:   # the binding's errors, an nvmlInit that fails as a broken driver's does
        NVMLError = nvml.NVMLError

        @staticmethod
        def nvmlInit():
            raise nvml.NVMLError(code)
    with pytest.raises(ProbeUnavailable, match=why):
        GpuProbe(Host(), nvml=NoInit).start(PidTreeTarget([os.getpid()]))


def test_no_driver_probe_unavailable_agent_goes_on(spawn):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML", "LD_LIBRARY_PATH"))}
    env["PYTHONPATH"] = str(ROOT)
    found = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"], env=env)
    if found.returncode == 0:
        pytest.skip("a real NVIDIA driver is installed here")
    code = ("import pynvml\nfrom jobprobe.kernel.host import Host\nfrom probes.gpu import GpuProbe\n"
            "try:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError_LibraryNotFound:\n    print('LibraryNotFound')\n"
            "print(GpuProbe().check(Host()))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.splitlines() == ["LibraryNotFound", NO_DRIVER], out.stderr
    job = spawn(seconds=30)
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,gpu", "--stdout", "json",
                          "--pid", str(job.pid), "--interval", "0.2", "--duration", "0.5"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    frames = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert res.returncode == 0, res.stderr
    assert frames[0]["probes"] == {"cgroup": "ok", "gpu": f"unavailable: {NO_DRIVER}"}
    assert all("cgroup" in f["probes"] and "gpu" not in f["probes"] for f in frames[1:])


def real_gpu() -> tuple[dict, list[str]]:
    """Environment without the fake, and (GPU count, GPU 0's UUID, its memory) from the real NVML; else skip."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML", "LD_LIBRARY_PATH"))}
    env["PYTHONPATH"] = str(ROOT)
    ask = ("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); "
           "print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetMemoryInfo(h).total)")
    real = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True)  # fresh process:
    if real.returncode != 0 or len(real.stdout.split()) != 3 or real.stdout.split()[0] == "0":  # the fake is here
        pytest.skip("no NVIDIA GPU on this host")
    return env, real.stdout.split()


def run_on(env, pid, seconds=2.2):
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "gpu", "--stdout", "json",
                          "--pid", str(pid), "--interval", "0.5", "--duration", str(seconds)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [json.loads(ln)["probes"]["gpu"] for ln in res.stdout.splitlines() if '"sample"' in ln]


@pytest.mark.gpu
def test_real_gpu_job_found_by_env_with_sane_values():
    """Real NVML, real GPU: a job told CUDA_VISIBLE_DEVICES=0 gets GPU 0, with values NVML itself agrees on."""
    env, (_, uuid, total) = real_gpu()
    job = subprocess.Popen(["sleep", "30"], env={**env, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        ticks = run_on(env, job.pid)
    finally:
        job.kill()
        job.wait()
    assert len(ticks) >= 4
    for t in ticks:    # (in a container on a cgroup v1 host its device cgroup may name the GPU first)
        g = t["gpus"][0]
        assert (g["index"], g["uuid"], g["mem_total_bytes"]) == (0, uuid, int(total))
        assert g["rule"] in ("env", "devices")
        assert 0 <= g["util_gpu_pct"] <= 100 and 0 < g["power_mw"] < 2_000_000 and 10 < g["temp_c"] < 110
        assert 0 < g["sm_clock_mhz"] < 5000 and g["mem_used_bytes"] <= g["mem_total_bytes"] and g["energy_mj"] >= 0


@pytest.mark.gpu
def test_real_cuda_process_found_on_the_process_list():
    env, _ = real_gpu()
    code = ("import time, torch; x = torch.ones(256 << 20, device='cuda'); torch.cuda.synchronize(); "
            "print('ready', flush=True); time.sleep(8)")
    job = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if job.stdout.readline().strip() != "ready":
            pytest.skip("no PyTorch with CUDA here")
        ask = ("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); "
               "print(*[p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])")
        listed = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True).stdout.split()
        if str(job.pid) not in listed:
            pytest.skip(f"NVML lists PIDs {listed} here, not ours ({job.pid}): another PID namespace (a container)")
        ticks = run_on(env, job.pid)
    finally:
        job.kill()
        job.wait()
    g = ticks[-1]["gpus"][0]
    assert g["rule"] == "process" and g["procs"][0]["pid"] == job.pid and g["job_mem_bytes"] >= 1 << 30


# ---- the job's own share of a shared GPU (per-process utilization, accounting) -------------------------------------
def test_two_jobs_on_one_gpu_each_get_their_own_share_and_the_rest_is_others(fake, spawn, probes):
    """Jobs A and B and a third process C on GPU 0, with per-process samples written to the fake: each job's SM
    share is the mean of its own process's samples, `others` the rest, and job + others is the GPU's figure (the
    fake's device utilization, set to the samples' sum). Each sample is read once: the next tick, with no new
    sample, reads 0; a later sample counts in the tick after it."""
    a, b, c = spawn(), spawn(), spawn()
    fake.gpu(0, procs=f"{a.pid}:{GiB} {b.pid}:{2 * GiB} {c.pid}:{GiB}", putil=f"{a.pid}:500:99:99:0:0").write()
    pa, pb = probes(PidTreeTarget([a.pid])), probes(PidTreeTarget([b.pid]))   # the old sample: left behind
    fake.gpu(0, util="58 20", putil=" ".join([f"{a.pid}:1000:30:10:0:0", f"{a.pid}:2000:34:12:4:0",
                                              f"{b.pid}:1000:20:5:0:2", f"{b.pid}:2000:22:7:0:2",
                                              f"{c.pid}:1500:5:1:0:0"])).write()
    ga, gb = pa.sample()["gpus"][0], pb.sample()["gpus"][0]
    assert (ga["job_sm_pct"], ga["job_mem_util_pct"], ga["job_enc_pct"], ga["others_sm_pct"]) == (32, 11, 2, 26)
    assert (gb["job_sm_pct"], gb["job_dec_pct"], gb["others_sm_pct"]) == (21, 2, 37)
    assert ga["job_sm_pct"] + ga["others_sm_pct"] == gb["job_sm_pct"] + gb["others_sm_pct"] == ga["util_gpu_pct"]
    assert ga["util_samples"] == 5 and ga["util_source"] == "ProcessesUtilizationInfo"
    assert ga["sharing"] == gb["sharing"] == "time-slicing" and ga["job_mem_share"] == 0.1     # 1 GiB of 10
    # energy on the shared GPU: each job's part by its share of the processes' SM samples (fake NVML's counter)
    fake.gpu(0, energy=5_000_000 + 58_000).write()
    ea, eb = pa.sample()["gpus"][0], pb.sample()["gpus"][0]
    assert ea["energy_mj"] == eb["energy_mj"] == 58_000
    fake.gpu(0, putil=" ".join([f"{a.pid}:4000:30:0:0:0", f"{b.pid}:4000:20:0:0:0", f"{c.pid}:4000:8:0:0:0"])).write()
    fake.gpu(0, energy=5_000_000 + 2 * 58_000).write()
    ea, eb = pa.sample()["gpus"][0], pb.sample()["gpus"][0]
    assert (ea["job_energy_mj"], ea["energy_split"], eb["job_energy_mj"]) == (30_000, "sm_share", 20_000)
    fake.gpu(0, putil=f"{a.pid}:3000:50:0:0:0", energy=5_000_000).write()
    pa.sample()
    again = pa.sample()["gpus"][0]
    assert (again["job_sm_pct"], again["util_samples"]) == (0, 0)          # no sample twice
    fake.gpu(0, putil=f"{a.pid}:5000:50:0:0:0").write()
    assert pa.sample()["gpus"][0]["job_sm_pct"] == 50


def test_a_process_that_exits_between_ticks_is_counted_once_through_accounting(fake, spawn, probes):
    """Accounting mode on: a job process seen on the GPU exits mid-interval; the next frame lists it in `exited`
    with the driver's record of its whole life, and no later frame lists it again. With accounting off there is
    no record to give: `accounting` false, nothing in `exited`."""
    a1, a2 = spawn(), spawn()
    fake.gpu(0, procs=f"{a1.pid}:{GiB} {a2.pid}:{GiB}", accounting=1,
             acct=f"{a1.pid}:60:20:{GiB}:9000:100:1 {a2.pid}:40:10:{2 * GiB}:1500:200:0").write()
    ta = PidTreeTarget([a1.pid, a2.pid])
    p = probes(ta)
    first = p.sample()["gpus"][0]
    assert first["accounting"] is True and "exited" not in first
    a2.kill()
    a2.wait()
    fake.gpu(0, procs=f"{a1.pid}:{GiB}").write()
    ta.refresh()                                  # (the sampler's tick refreshes the target first)
    told = p.sample()["gpus"][0]["exited"]
    assert told == [{"pid": a2.pid, "gpu_util_pct": 40, "mem_util_pct": 10, "max_mem_bytes": 2 * GiB,
                     "time_ms": 1500}]
    assert "exited" not in p.sample()["gpus"][0]
    b1, b2 = spawn(), spawn()
    fake.gpu(0, procs=f"{b1.pid}:{GiB} {b2.pid}:{GiB}", accounting=0).write()
    tb = PidTreeTarget([b1.pid, b2.pid])
    q = probes(tb)
    q.sample()
    b2.kill()
    b2.wait()
    tb.refresh()
    g = q.sample()["gpus"][0]
    assert g["accounting"] is False and "exited" not in g


def test_a_driver_without_the_newer_call_falls_back_and_unsupported_is_said_once(fake, spawn, probes):
    """nvmlDeviceGetProcessesUtilizationInfo missing from the driver (FUNCTION_NOT_FOUND): the older
    nvmlDeviceGetProcessUtilization gives the same share, and the newer one is never asked again. Per-process
    utilization not supported on a GPU: the fields are absent, `unsupported` says so in one frame, and the driver
    is asked once (the fake's call log)."""
    job = spawn()
    fake.gpu(0, procs=f"{job.pid}:{GiB}", missing="nvmlDeviceGetProcessesUtilizationInfo").write()
    p = probes(PidTreeTarget([job.pid]))
    fake.gpu(0, putil=f"{job.pid}:1000:44:3:0:0 {job.pid}:2000:46:5:0:0").write()
    g = [p.sample()["gpus"][0] for _ in range(3)]
    assert (g[0]["job_sm_pct"], g[0]["util_source"]) == (45, "ProcessUtilization") and g[1]["job_sm_pct"] == 0
    assert fake.calls("nvmlDeviceGetProcessesUtilizationInfo") == 1
    other = spawn()
    fake.gpu(1, procs=f"{other.pid}:{GiB}", unsupported="nvmlDeviceGetProcessesUtilizationInfo").write()
    q = probes(PidTreeTarget([other.pid]))
    frames = [q.sample() for _ in range(3)]
    assert all("job_sm_pct" not in f["gpus"][0] for f in frames)
    said = [f.get("unsupported", []) for f in frames]
    assert said[0] == ["gpu1.process_util"] or "gpu1.process_util" in sum(said, [])
    assert sum(s.count("gpu1.process_util") for s in said) == 1
    assert fake.calls("nvmlDeviceGetProcessesUtilizationInfo", 1) == 1
