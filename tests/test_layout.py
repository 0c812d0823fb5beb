# SPDX-License-Identifier: Apache-2.0
"""Unit tier: the import contract (docs/ARCHITECTURE.md, "Rooms"), checked on the source's syntax trees: data flows
one way, so each room imports only the rooms below it. Every import counts — at module level, inside a function,
and under `if TYPE_CHECKING:` (an annotation that names a room above is an arrow back up all the same)."""
import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# room → the rooms (jobprobe.<room>) it may import, itself included
ALLOWED = {
    "core": {"core"},
    "kernel": {"core", "kernel", "bpf"},
    "devices": {"core", "kernel", "devices"},
    "contract": {"core", "kernel", "devices", "contract", "bpf"},
    "transport": {"core", "transport"},
    "exporters": {"core", "transport", "exporters"},
    "probes": {"core", "kernel", "devices", "contract", "bpf"},
    "node": {"core", "kernel", "devices", "contract", "transport", "exporters", "node", "probes", "bpf"},
    "cluster": {"core", "transport", "cluster"},
}
SOURCES = {"probes": ROOT / "probes", "exporters": ROOT / "exporters"} | {
    room: ROOT / "jobprobe" / room for room in ("core", "kernel", "devices", "contract", "transport", "node",
                                                "cluster")}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every jobprobe import the file runs."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, f"{node.module}.{a.name}" if node.module in ("jobprobe", *(f"jobprobe.{r}" for r in
                    ALLOWED)) else node.module) for a in node.names]
    return [(line, m) for line, m in out if m == "jobprobe" or m.startswith("jobprobe.")]


def violations(room: str, path: Path) -> list[str]:
    bad = []
    for line, mod in imports(path):
        parts = mod.split(".")
        target = parts[1] if len(parts) > 1 else ""
        ok = target in ALLOWED[room] or target == "__version__"
        if not ok:
            bad.append(f"{path.relative_to(ROOT)}:{line} ({room}) imports {mod}")
    return bad


@pytest.mark.parametrize("room", sorted(SOURCES))
def test_each_room_imports_only_the_rooms_below_it(room):
    files = sorted(SOURCES[room].glob("*.py")) + sorted(SOURCES[room].glob("*/*.py"))
    assert files, f"no source in {SOURCES[room]}"
    bad = [v for f in files for v in violations(room, f)]
    assert not bad, "imports against the contract:\n" + "\n".join(bad)


def test_the_contract_test_sees_a_violation(tmp_path):
    """The checker itself: an upward import, one inside a function, one under TYPE_CHECKING and a `from jobprobe
    import room` form are all caught."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nfrom jobprobe.core import errors\nif TYPE_CHECKING:\n"
                 "    from jobprobe.contract.target import Target\n"
                 "def f():\n    from jobprobe.node import agent\n    import jobprobe.cluster.store\n")
    (tmp_path / "jobprobe").mkdir()
    got = [m for _, m in imports(f)]
    assert got == ["jobprobe.core.errors", "jobprobe.contract.target", "jobprobe.node.agent",
                   "jobprobe.cluster.store"]



def test_the_linter_passes_and_sees_what_it_is_for(tmp_path):
    """ruff with the project's settings (pyproject.toml: import order, unused and undefined names, a complexity
    bound) passes on the tree — scripts/test.sh runs it first too — and flags a file with unsorted imports, an
    unused one and a function past the bound."""
    ruff = ROOT / ".venv" / "bin" / "ruff"
    res = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(30))
    (tmp_path / "bad.py").write_text("import sys\nimport os\n\n\ndef f(x):\n" + branches + "    return os.sep\n")
    res = subprocess.run([str(ruff), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                          str(tmp_path / "bad.py")], capture_output=True, text=True)
    assert res.returncode == 1 and all(code in res.stdout for code in ("I001", "F401", "C901")), res.stdout


def test_every_source_file_says_its_license():
    """LICENSE is Apache-2.0; every source file says so in an SPDX line at its top — the eBPF programs dual
    licensed (Apache-2.0 OR GPL-2.0-only): the kernel gives GPL-only helpers only to programs that declare "GPL"."""
    import subprocess
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200] and "Version 2.0" in (ROOT / "LICENSE").read_text()
    files = subprocess.run(["git", "ls-files", "*.py", "*.c", "*.h", "*.sh"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    assert files
    for f in files:
        head = "\n".join((ROOT / f).read_text().splitlines()[:2])
        want = "Apache-2.0 OR GPL-2.0-only" if f.startswith("bpf/") and f.endswith((".c", ".h")) else "Apache-2.0"
        assert f"SPDX-License-Identifier: {want}" in head, f
