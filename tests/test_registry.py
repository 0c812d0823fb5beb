"""Unit tier: probe toggles (--probes) and the registry; a meta-test that every probe has a test file and every
field it declares is documented in docs/FRAMES.md."""
from pathlib import Path

import pytest

from jobprobe.errors import BadInput
from jobprobe.probe import Field, Probe
from jobprobe.registry import all_probes, parse_probes, standard

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
    import subprocess, sys
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "frames_doc.py"), "--check"])
    assert res.returncode == 0, "docs/FRAMES.md is out of date: run python scripts/frames_doc.py"
