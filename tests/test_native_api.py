"""forecache's C API as Python binds it: a typed stub for every function of forecache.h (and the
test controls of forecache-testing.h apart), the stats struct from the header's one field list,
and LLAMA_MAX_SEQ from the patch series."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from forecache import native
from forecache.native import cache_api, libs, testing

if TYPE_CHECKING:
    from conftest import StockReference


def _declared(header: str) -> set[str]:
    """The functions a header of csrc declares, less the ``forecache_`` prefix."""
    text = (libs.CSRC_DIR / header).read_text()
    return {n.removeprefix("forecache_")
            for n in re.findall(r"^LLAMA_API\b[^(;]*?\b(forecache_\w+)\s*\(", text, re.MULTILINE)}


def test_every_function_has_one_stub_where_its_header_is() -> None:
    api, controls = _declared("forecache.h"), _declared("forecache-testing.h")
    assert len(api) > 40 and len(controls) > 5 and not api & controls
    assert set(cache_api.ForecacheAPI.stubs()) == api
    assert set(testing.ForecacheTestControls.stubs()) == controls


def test_the_runtime_binding_looks_up_no_test_control() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.names: list[str] = []

        def __getattr__(self, name: str) -> object:
            self.names.append(name)
            return type("CFunction", (), {})()

    lib = Recorder()
    bound = cache_api.ForecacheAPI.bind(lib)  # type: ignore[arg-type]
    assert sorted(lib.names) == sorted(f"forecache_{n}" for n in _declared("forecache.h"))
    assert bound.cache_load.argtypes == [ctypes.c_void_p] + [ctypes.c_int32] * 4


def test_bound_functions_are_the_library_functions_with_the_stubs_attached() -> None:
    import inspect

    api, lib = native.api(), native.libllama()
    assert api.cache_load is lib.forecache_cache_load  # a call costs a ctypes call, no more
    assert api.cache_load.restype is ctypes.c_int32
    assert list(inspect.signature(api.cache_load).parameters) == ["cache", "layer", "expert",
                                                                   "slot", "priority"]
    assert "queue" in api.cache_load.__doc__
    assert testing.controls().chunk_info_size() == ctypes.sizeof(testing.ChunkInfo)


def test_stats_mirror_is_the_struct_the_compiler_lays_out(tmp_path: Path) -> None:
    """CacheStats comes from FORECACHE_CACHE_STATS_FIELDS as read by a regex; the compiler
    builds the struct from the same list: every field's name, offset and the size agree."""
    cc = shutil.which("cc")
    assert cc, "no C compiler (cc): the build needs one, and so does this test"
    (tmp_path / "llama.h").write_text("#define LLAMA_API\n")  # stands in for llama.cpp's header
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "forecache.h"\n'
                   '#define PRINT(type, name, combine) printf("%s %zu\\n", #name, '
                   'offsetof(struct forecache_cache_stats, name));\n'
                   'int main(void) {\n    FORECACHE_CACHE_STATS_FIELDS(PRINT)\n'
                   '    printf("sizeof %zu\\n", sizeof(struct forecache_cache_stats));\n'
                   '    return 0;\n}\n')
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(tmp_path), "-I", str(libs.CSRC_DIR), str(src),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    c_layout = subprocess.run([str(exe)], check=True, capture_output=True,
                              text=True).stdout.split("\n")
    mirror = [f"{name} {getattr(cache_api.CacheStats, name).offset}"
              for name, _ in cache_api.CacheStats._fields_]
    assert c_layout == mirror + [f"sizeof {ctypes.sizeof(cache_api.CacheStats)}", ""]


def test_stats_field_list_is_required_and_its_types_known(tmp_path: Path) -> None:
    text = cache_api.HEADER.read_text()
    fields = cache_api.stats_fields()
    assert fields[0] == ("hits", ctypes.c_uint64) and ("copy_s", ctypes.c_double) in fields
    odd = tmp_path / "odd.h"
    odd.write_text(text.replace("X(double,   copy_s,", "X(float,    copy_s,"))
    with pytest.raises(RuntimeError, match=r"does not map: \['float'\]"):
        cache_api.stats_fields(odd)
    gone = tmp_path / "gone.h"
    gone.write_text(text.replace("#define FORECACHE_CACHE_STATS_FIELDS(X)", "#define OTHER(X)"))
    with pytest.raises(RuntimeError, match="does not define FORECACHE_CACHE_STATS_FIELDS"):
        cache_api.stats_fields(gone)


def test_max_sequences_come_from_the_patch_series() -> None:
    assert (libs.STOCK_MAX_SEQUENCES, libs.MAX_SEQUENCES) == (256, 1024)
    low = native.llama_cpp_module()
    assert low.llama_max_parallel_sequences() == libs.MAX_SEQUENCES


def test_stock_max_sequences_is_the_unpatched_librarys(stock: StockReference) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stock.site), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", "import llama_cpp.llama_cpp as low; "
                          "print(low.llama_max_parallel_sequences())"], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert int(out) == libs.STOCK_MAX_SEQUENCES
