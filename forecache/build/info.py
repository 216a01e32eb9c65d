"""What the runtime needs to know about a build: where the C sources and the patch series it was
built from live, the build record inside the installed package, and whether this CPU can run what
it was compiled for.

Kept apart from the build machinery so that ``forecache.native`` imports only this.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# forecache's C/C++ sources and the patch series ship inside the package (an installed wheel can
# build too); the runtime reads FORECACHE_PATCH_VERSION from csrc/forecache.h.
CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
PATCH_DIR = Path(__file__).resolve().parents[1] / "data" / "patches"
# The build record written into the llama_cpp package (and next to a cached wheel).
BUILD_INFO_NAME = "forecache_build.json"

# CPU flags (/proc/cpuinfo names) that name instruction sets a -march=native build may use. Two
# machines that differ in any of them get different cached builds: a wheel compiled for AVX-512
# or AMX dies with SIGILL on a CPU without them.
_ISA_FLAG = re.compile(r"^(sse\w*|ssse3|pni|avx\w*|amx\w*|fma\w*|f16c|bmi\w*|vnni\w*|gfni|vaes|"
                       r"vpclmulqdq|sha_ni|popcnt|movbe|adx|abm|lzcnt|xop|asimd\w*|sve\w*|i8mm|"
                       r"dotprod|fphp|bf16|sme\d*)$")


def cpu_features(cpuinfo: str | None = None, isa_only: bool = True) -> list[str]:
    """The instruction-set flags of this CPU, sorted (from /proc/cpuinfo; elsewhere the machine
    name, since the build cannot tell more); ``isa_only=False``: every flag."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            import platform

            return [platform.machine() or "unknown"]
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(f for f in value.split() if not isa_only or _ISA_FLAG.match(f))
    return sorted(flags)


def missing_cpu_features(info: dict) -> list[str]:
    """The instruction sets a build (its build info) was compiled for that this CPU lacks."""
    built = info.get("cpu_features")
    if not built:
        return []
    return sorted(set(built) - set(cpu_features(isa_only=False)))


def installed_build_info() -> dict | None:
    """The build-info of the llama_cpp package installed in this environment, if it is ours."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / BUILD_INFO_NAME
        if p.exists():
            try:
                return json.loads(p.read_text())
            except json.JSONDecodeError:
                return None
    return None
