# SPDX-License-Identifier: Apache-2.0
"""jobprobe: attach to one training job, sample probes every tick, emit one msgpack frame per job per tick.

Three rooms of the package live at the top of the checkout, where the design puts them: probes/, exporters/ and
bpf/ are jobprobe.probes, jobprobe.exporters and jobprobe.bpf. An installed wheel has them under jobprobe/
(setup.cfg's package_dir); run from a checkout, the finder below gives each its folder — so a traceback names
probes/gpu.py, the path git knows.
"""
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

ROOMS = ("probes", "exporters", "bpf")


class _CheckoutRooms(importlib.abc.MetaPathFinder):
    """jobprobe.<room> → the checkout's top-level <room>/ (only where jobprobe/<room> is absent: not in a wheel)."""

    def __init__(self, rooms: dict[str, str]):
        self.rooms = rooms

    def find_spec(self, name, path=None, target=None):
        where = self.rooms.get(name)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])


def _rooms() -> dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    top = os.path.dirname(here)
    return {f"{__name__}.{r}": os.path.join(top, r) for r in ROOMS
            if not os.path.isdir(os.path.join(here, r)) and os.path.isfile(os.path.join(top, r, "__init__.py"))}


if _rooms() and not any(isinstance(f, _CheckoutRooms) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutRooms(_rooms()))
