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
    """The CPU's name as the kernel reports it with its family and model numbers, e.g. ``AMD EPYC
    (family 25, model 17)``: a virtual machine's name may say no more than the vendor's line
    (an EPYC 7002 and an EPYC 9004 are both "AMD EPYC"), the numbers tell the generation."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"
    return fields["model name"]


#: CPU flags that decide which matrix/vector paths the kernels (ours and the peers') can take.
MATRIX_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8")


def matrix_features() -> list[str]:
    """The :data:`MATRIX_FLAGS` this CPU has (from ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [f for f in MATRIX_FLAGS if f in flags]
    except OSError:
        pass
    return []


def run_stamp() -> dict[str, object]:
    """``date`` (UTC, to the minute), ``cpu_model``, ``cpus`` (usable by this process), the CPU's
    ``matrix_features`` and the ``load_average`` (1, 5, 15 min) when stamped."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 0
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_model": cpu_model(), "cpus": cpus,
            "matrix_features": matrix_features(), "load_average": [round(x, 2) for x in os.getloadavg()]}


if __name__ == "__main__":
    print(run_stamp())
