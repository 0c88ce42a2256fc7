"""The cpu kernels' sources compile for the x86-64 targets other machines have, not only this one.

The kernels are built on each machine with ``-march=native`` (kernels.py), so the test suite's
own build covers only this CPU's branches: the AVX2 spellings (``#else`` of ``__AVX512F__``) and
the builds without vector integer products (no ``FD_INT8_DOT``) compile only on such CPUs. Each
source is checked here with ``g++ -fsyntax-only`` for the baseline x86-64 (SSE2 only: the scalar
loops) and for x86-64-v3 (AVX2 + FMA + F16C, an AVX2-only EPYC's ISA), with the include paths
and language flags of the real build. A source that no longer compiles for one of them fails
here instead of on the first such machine (weight_only_gemm.cc once read FD_INT8_DOT, which the
baseline build does not define). Syntax only: nothing is linked or run.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastdeploy_core.builtin.cpu import kernels

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
    reason="the kernels' x86-64 targets are checked on an x86-64 machine with g++",
)

TARGETS = ("x86-64", "x86-64-v3")


def _compile_flags(target: str) -> list[str]:
    from paddle.utils.cpp_extension.extension_utils import find_paddle_includes

    includes = [*find_paddle_includes(), sysconfig.get_paths()["include"]]
    flags = [f for f in kernels.CXX_FLAGS if not f.startswith("-march=")]
    return ["g++", *flags, f"-march={target}", "-fsyntax-only", "-w", "-DPADDLE_WITH_CUSTOM_KERNEL",
            *(f"-I{path}" for path in includes)]


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_source_compiles_for_the_target(target):
    flags = _compile_flags(target)

    def check(source):
        done = subprocess.run([*flags, str(source)], capture_output=True, text=True)
        return source.name, done.returncode, done.stderr

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(check, kernels.SOURCES))
    failed = [f"{name}:\n{err[-2000:]}" for name, code, err in results if code != 0]
    assert not failed, f"sources that do not compile for -march={target}:\n" + "\n".join(failed)
    assert len(results) == len(kernels.SOURCES) > 0


def test_every_source_of_the_directory_is_built_and_every_included_header_hashed():
    # A .cc left out of SOURCES is never compiled. The library's name hashes SOURCES and HEADERS,
    # so a header a kernel includes from anywhere else would not rebuild the kernels when edited.
    import re

    csrc = kernels.SOURCES[0].parent
    assert sorted(csrc.glob("*.cc")) == sorted(kernels.SOURCES)
    hashed = {path.resolve() for path in kernels.HEADERS}
    included = set()
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        for name in re.findall(r'#include "([^"]+)"', path.read_text()):
            if not name.startswith("paddle/"):
                included.add((path.parent / name).resolve())
    assert len(included) >= 10
    assert included <= hashed, f"included but not hashed: {sorted(str(p) for p in included - hashed)}"
