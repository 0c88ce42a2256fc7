"""Work stealing measured: three instances on this machine, all traffic sent to instance A.

For each scheduler (``local``, then ``global`` on one redis-server started here on a free
loopback port) it starts three ``fastdeploy serve`` instances, each with one thread
(``OMP_NUM_THREADS=1``, ``FD_CPU_KERNEL_THREADS=1``), and runs ``fastdeploy bench serve``
against A only at each concurrency (default 16 and 64). With ``local``, B and C idle; with
``global`` they take queued requests from A. It prints output tok/s and TTFT p50/p99 per run and
how many requests B and C took, and writes every summary as JSON with the run's stamp (date,
CPU) and the machine's load average before and after: other work on the same cores shrinks
every figure, and the stamp says how busy the machine was.

    python benchmarks/global_scheduler.py --num-prompts 128 --result-file /tmp/global.json

Needs ``redis-server`` on PATH (Debian: ``apt-get install redis-server``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import fastdeploy, free_port, wait_healthy
from run_stamp import run_stamp

SECRET = "benchmark-secret"


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             workdir, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            start_new_session=True)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def start_instance(workdir: str, args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [*fastdeploy(), "serve", "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
           str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", FD_CPU_KERNEL_THREADS="1", FD_API_KEY="")
    with open(os.path.join(workdir, f"serve-{port}.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, port


def counter(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def bench(port: int, concurrency: int, args: argparse.Namespace, label: str, workdir: str) -> dict:
    out = os.path.join(workdir, f"{label}.json")
    subprocess.run([*fastdeploy(), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts",
                    str(args.num_prompts), "--max-concurrency", str(concurrency), "--random-input-len",
                    str(args.input_len), "--random-output-len", str(args.output_len), "--result-file", out,
                    "--label", label], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def run(scheduler: str, args: argparse.Namespace, workdir: str) -> list[dict]:
    redis_proc = None
    extra: list[str] = []
    if scheduler == "global":
        redis_proc, redis_port = start_redis(workdir)
        extra = ["--scheduler-name", "global", "--scheduler-port", str(redis_port), "--scheduler-secret", SECRET,
                 "--scheduler-min-load-score", str(args.min_load_score)]
    instances = [start_instance(workdir, args, extra) for _ in range(3)]
    try:
        for proc, port in instances:
            wait_healthy(port, proc)
        a_port = instances[0][1]
        rows = []
        for concurrency in args.concurrency:
            stolen_before = [counter(p, "fastdeploy:scheduler_requests_stolen_total") for _, p in instances[1:]]
            summary = bench(a_port, concurrency, args, f"{scheduler}-c{concurrency}", workdir)
            stolen = [counter(p, "fastdeploy:scheduler_requests_stolen_total") - b
                      for (_, p), b in zip(instances[1:], stolen_before)]
            rows.append({"scheduler": scheduler, "concurrency": concurrency, "taken_by_b_c": stolen,
                         "output_throughput": summary["output_throughput"], "ttft_ms": summary["ttft_ms"],
                         "summary": {k: v for k, v in summary.items() if k != "per_request"}})
        return rows
    finally:
        for proc, _ in instances:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in instances:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--min-load-score", type=int, default=3)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="fd-global-bench-")
    load_before = os.getloadavg()
    rows = run("local", args, workdir) + run("global", args, workdir)
    load_after = os.getloadavg()
    print(f"{'scheduler':<10}{'conc':>6}{'out tok/s':>12}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}  taken by B, C")
    for row in rows:
        ttft = row["ttft_ms"]
        print(f"{row['scheduler']:<10}{row['concurrency']:>6}{row['output_throughput']:>12.1f}"
              f"{ttft['median']:>14.1f}{ttft['p99']:>14.1f}  {row['taken_by_b_c']}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            settings = {k: v for k, v in vars(args).items() if k != "result_file"}
            json.dump({**run_stamp(), "load_average_before": load_before, "load_average_after": load_after,
                       "settings": settings, "runs": rows}, f, indent=2)
    print(f"logs in {workdir}")


if __name__ == "__main__":
    main()
