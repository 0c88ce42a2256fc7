"""After a model load, a step's freed activations stay in the heap for the next step.

``returned_after_loading`` fixes glibc's mmap threshold, which also fixes its trim threshold;
left at glibc's 128 KiB default, every freed activation of more than that at the heap's top
went back to the system and the next op faulted it in again (~110k page faults per 512-token
prefill). Run in a subprocess: the test changes the process's malloc settings.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")

SCRIPT = textwrap.dedent(
    """
    import ctypes, resource, sys
    import numpy as np
    from fastdeploy_core.host_memory import returned_after_loading

    def faults_of_cycles(n=20, mib=8):
        np.ones(mib << 18, dtype=np.float32)  # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            a = np.ones(mib << 18, dtype=np.float32)  # 8 MiB: below the mmap threshold, from the heap
            del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    if sys.argv[1] == "after_load":
        with returned_after_loading():
            pass
    else:  # the trim threshold glibc keeps after a fixed mmap threshold: 128 KiB
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)
    print(faults_of_cycles())
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_freed_activations_are_reused_not_faulted_in_again():
    # 20 cycles of an 8 MiB array (2048 pages each).
    assert _faults("fixed_threshold_only") > 5000  # measured ~9700: about half of each cycle faulted in
    assert _faults("after_load") < 200
