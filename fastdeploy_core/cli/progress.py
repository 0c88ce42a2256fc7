"""Progress with an ETA for the long commands (``bench latency``, ``throughput``, ``serve``).

The bar goes to stderr and only when stderr is a terminal: piped or captured output (CI logs,
``> result.txt``, the tests) stays exactly the report it was.
"""

from __future__ import annotations

import sys

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}, ETA {remaining}]"


def progress_bar(total: int, desc: str, unit: str):
    """A tqdm bar of ``total`` ``unit``; a silent one when stderr is not a terminal."""
    from tqdm import tqdm

    stream = sys.stderr
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=stream,
        disable=not stream.isatty(),
        leave=False,
        dynamic_ncols=True,
        bar_format=BAR_FORMAT,
    )
