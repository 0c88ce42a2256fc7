"""Test-run set-up and reporting shared by the core's tests and the plugins' tests."""

# The cpu kernels are tested on every CPU, also one with neither AVX-512 nor AVX2 + FMA, where the
# engine would not choose them by itself (fastdeploy_core/builtin/cpu/kernels.py says why); in
# the test process only: the servers and workers tests start choose as a user's would.
from fastdeploy_core.builtin.cpu.kernels import choose_kernels_on_any_cpu

choose_kernels_on_any_cpu()


def pytest_runtest_logreport(report):
    """Print a failure the moment it happens (its test id and the end of its traceback), not only
    in the summary: a run that dies later (a crashed interpreter, a CI time limit) still shows
    which tests failed and why."""
    if not report.failed:
        return
    text = str(report.longrepr or "")
    tail = "\n".join(text.splitlines()[-40:])
    import sys

    sys.stderr.write(f"\n----- FAILED {report.nodeid} ({report.when}) -----\n{tail}\n-----\n")
    sys.stderr.flush()
