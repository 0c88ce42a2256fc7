"""When and on what a benchmark ran: the stamp every result file in benchmarks/results carries.

A figure without its machine cannot be compared with another one: the same code measured on a
2-vCPU AMD EPYC and on an Intel Xeon differs by more than most changes it is meant to show. The
CPU model comes from ``/proc/cpuinfo`` ("model name"; the platform's processor string elsewhere).
"""

from __future__ import annotations

import os
import platform
import time


def cpu_model() -> str:
    """The CPU's name as the kernel reports it, e.g. ``Intel(R) Xeon(R) Processor``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_stamp() -> dict[str, object]:
    """``date`` (UTC, to the minute), ``cpu_model`` and ``cpus`` (usable by this process)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 0
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_model": cpu_model(), "cpus": cpus}


if __name__ == "__main__":
    print(run_stamp())
