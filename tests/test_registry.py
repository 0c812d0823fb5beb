# SPDX-License-Identifier: Apache-2.0
"""Unit tier: probe toggles (--probes) and the registry; a meta-test that every probe has a test file and every
field it declares is documented in docs/FRAMES.md."""
import inspect
from pathlib import Path

import pytest

from jobprobe.contract.bpfprobe import BpfProbe
from jobprobe.contract.probe import FIELD_KINDS, Field, Probe, infer_kind
from jobprobe.core.errors import BadInput
from jobprobe.kernel.host import Host
from jobprobe.node.registry import all_probes, parse_probes, standard

ROOT = Path(__file__).resolve().parents[1]


class P(Probe):
    pass


def fake_registry():
    reg = {}
    for name, default in (("cgroup", True), ("perf", True), ("sched", True), ("pystacks", False), ("cuda", False)):
        reg[name] = type(name, (P,), {"name": name, "default": default})
    return reg


@pytest.mark.parametrize("spec,want", [
    (None, ["cgroup", "perf", "sched"]),
    ("sched,perf", ["sched", "perf"]),
    ("+pystacks,-sched", ["cgroup", "perf", "pystacks"]),
    ("-perf", ["cgroup", "sched"]),
    ("all", ["cgroup", "perf", "sched", "pystacks", "cuda"]),
    ("all,-cuda", ["cgroup", "perf", "sched", "pystacks"]),
    ("cgroup,+cuda", ["cgroup", "cuda"]),
    (" sched , sched ", ["sched"]),
])
def test_parse_probes(spec, want):
    assert parse_probes(spec, fake_registry()) == want


def test_unknown_probe_lists_the_valid_ones():
    with pytest.raises(BadInput, match="unknown probe 'nope'; valid probes: cgroup, perf, sched, pystacks, cuda"):
        parse_probes("sched,nope", fake_registry())


def test_names_after_edits_are_refused():
    with pytest.raises(BadInput):
        parse_probes("+cuda,sched", fake_registry())


def test_registry_finds_real_probes_with_declared_fields():
    reg = all_probes()
    assert {"cgroup", "self"} <= set(reg)
    assert set(standard(reg)) <= set(reg)
    for name, cls in reg.items():
        assert cls.name == name and cls.summary and cls.fields, name
        assert all(isinstance(f, Field) and f.unit and f.meaning for f in cls.fields.values()), name


def test_every_probe_has_its_test_file_and_docs():
    frames_md = (ROOT / "docs" / "FRAMES.md").read_text()
    probes_md = (ROOT / "docs" / "PROBES.md").read_text()
    for name, cls in all_probes().items():
        assert (ROOT / "tests" / f"test_{name}.py").is_file(), f"probe {name} has no tests/test_{name}.py"
        assert f"## {name}" in probes_md, f"probe {name} is not in docs/PROBES.md"
        for field in cls.fields:
            assert f"`{name}.{field}`" in frames_md, f"{name}.{field} is not documented in docs/FRAMES.md"


def test_frames_doc_tables_are_generated_from_the_declarations():
    import subprocess
    import sys
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "frames_doc.py"), "--check"])
    assert res.returncode == 0, "docs/FRAMES.md is out of date: run python scripts/frames_doc.py"


def test_every_field_of_every_probe_has_a_kind():
    for name, cls in all_probes().items():
        for k, f in cls.fields.items():
            assert f.kind in FIELD_KINDS, f"{name}.{k} has kind {f.kind!r}"
            if f.type == "list[int]" and k.endswith("_log2"):
                assert f.kind == "histogram", f"{name}.{k}"
            if f.kind == "histogram":
                assert f.type == "list[int]", f"{name}.{k}: a histogram is a bucket list"
            if f.type in ("str", "bool", "list[str]", "list[map]", "map"):
                assert f.kind == "info", f"{name}.{k}: only numbers count or measure"


@pytest.mark.parametrize("field,kind", [
    # inferred
    ("cgroup.cpu_user_ns", "counter"), ("cgroup.io_read_bytes", "counter"), ("cgroup.mem_bytes", "gauge"),
    ("cgroup.mem_peak_bytes", "gauge"), ("cgroup.nprocs", "gauge"), ("sched.runq_lat_us_log2", "histogram"),
    ("sched.runq_lat_p99_us", "gauge"), ("sched.offcpu_io_ns", "counter"), ("blockio.read_lat_p50_us", "gauge"),
    ("blockio.write_bytes", "counter"), ("blockio.bpf_missed", "counter"), ("perf.ipc", "gauge"),
    ("perf.cycles", "counter"), ("self.cpu_cores", "gauge"), ("self.rss_peak_bytes", "gauge"),
    ("syscalls.mem_calls", "counter"), ("syscalls.mem_ns", "counter"), ("syscalls.top", "info"),
    ("syscalls.slowest_class", "info"), ("cuda.memcpy_htod_bytes", "counter"), ("cuda.kernel_launches_per_s", "gauge"),
    ("gpu.gpus", "info"), ("gpu.gpus[].index", "info"), ("gpu.gpus[].temp_c", "gauge"),
    ("gpu.gpus[].sm_clock_mhz", "gauge"), ("gpu.gpus[].util_gpu_pct", "gauge"), ("gpu.gpus[].energy_mj", "counter"),
    ("gpu.gpus[].pcie_tx_bytes_per_s", "gauge"), ("gpu.gpus[].clock_event_reasons", "info"),
    ("gpu.gpus[].job_mem_bytes", "gauge"), ("gpu.gpus[].mig[].job_procs", "gauge"),
    ("gpu.gpus[].ecc_corrected", "counter"), ("net.top_peers[].port", "info"), ("net.top_peers[].tx_bytes", "counter"),
    ("memory.reclaimed_pages", "counter"),
    # declared, where the rule would say counter
    ("gpu.ngpus", "gauge"), ("gpu.node_gpus", "gauge"), ("cuda.libraries_probed", "gauge"),
    ("gpu.gpus[].remapped_rows_corrected", "gauge"), ("gpu.gpus[].remapped_rows_uncorrected", "gauge"),
])
def test_field_kinds(field, kind):
    probe, name = field.split(".", 1)
    assert all_probes()[probe].fields[name].kind == kind


def test_a_declared_kind_overrides_the_inference_and_a_bad_one_is_refused():
    lifetime = Field("int", "count", "rows remapped, lifetime", kind="gauge")
    assert infer_kind("remapped_rows", lifetime) == "counter"
    declared = type("Declared", (P,), {"name": "declared", "fields": {
        "remapped_rows": lifetime, "calls": Field("int", "count", "calls this interval")}})
    assert declared.fields["remapped_rows"] is lifetime
    assert declared.fields["calls"] == Field("int", "count", "calls this interval", "counter")
    with pytest.raises(TypeError, match="'rate'"):
        type("Bad", (P,), {"name": "bad", "fields": {"x": Field("float", "1/s", "x", kind="rate")}})


def signature_rule(cls: type[Probe], sinks) -> dict[str, bool]:
    """What the agent passed a probe before Probe.build, read from its constructor's signature: node= where it names
    `node` or takes **kw, sinks= where it names `sinks` and there are sinks. The reference build() must agree with."""
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {"node": "node" in params or takes_any, "sinks": "sinks" in params and sinks is not None}


@pytest.mark.parametrize("name", sorted(all_probes()))
def test_build_gives_every_probe_the_node_and_sinks_its_constructor_takes(name, monkeypatch):
    """Each registered probe's build(host, node, sinks) constructs it with the host and exactly what its constructor
    was given by the signature rule: an eBPF probe the agent's node (one load of its programs for every job), the
    cgroup probe too (whose an orphan's exit record is: the node's membership notes), the self probe the job's
    sinks, every other probe neither."""
    cls = all_probes()[name]
    host, node, sinks = Host(), object(), (lambda: {})
    for given in (sinks, None):
        rule = signature_rule(cls, given)
        assert rule["node"] == (issubclass(cls, BpfProbe) or name == "cgroup"), name
        assert rule["sinks"] == (name == "self" and given is not None), name
        seen: dict = {}
        init = cls.__init__

        def spy(self, *args, **kw):
            seen.update(args=args, kw=kw)
            init(self, *args, **kw)

        with monkeypatch.context() as m:
            m.setattr(cls, "__init__", spy)
            probe = cls.build(host, node, given)
        assert type(probe) is cls and probe.host is host and seen["args"] == (host,), name
        assert ("node" in seen["kw"]) == rule["node"] and seen["kw"].get("node", node) is node, (name, seen)
        assert set(seen["kw"]) <= {"node", "sinks"}, (name, seen)
        if rule["node"]:
            assert probe.node is node, name
        if rule["sinks"]:
            assert seen["kw"]["sinks"] is given and probe.sinks is given, name
        else:
            assert seen["kw"].get("sinks") is None and getattr(probe, "sinks", None) is None, (name, seen)
