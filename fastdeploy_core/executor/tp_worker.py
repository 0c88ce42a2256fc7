"""One rank of a tensor-parallel model: a process that runs a :class:`ModelRunner` on its share.

Started by :class:`~fastdeploy_core.executor.tensor_parallel.TensorParallelRunner` as
``python -m fastdeploy_core.executor.tp_worker FD`` with the rank's environment (Paddle's
rendezvous variables, the device's per-rank settings such as the cpu threads) and one end of
a socket pair as file descriptor ``FD``: an anonymous channel only the two processes hold (no
address, nothing else can connect), over which the driver and the worker exchange Python
objects.

driver -> worker: ``("init", engine_args_flat, rank, size, session)``, ``("blocks", n)``, ``("step",
SchedulerOutput)``, ``("close",)``; worker -> driver: ``("ready", num_blocks, info)``, ``("sized",)``,
``("output", RunnerOutput)`` (rank 0 only: every rank runs the step, rank 0's result is the
step's), ``("error", type, message, param)`` after which the worker exits.

Only the standard library is imported at the top: the environment decides Paddle's threads
before Paddle loads.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection


def _error(exc: BaseException) -> tuple:
    return ("error", type(exc).__name__, str(getattr(exc, "message", None) or exc), getattr(exc, "param", None))


def serve(conn: Connection) -> int:
    """Initialise the rank, then run steps until told to close; the exit status."""
    message = conn.recv()
    if message[0] != "init":
        return 2
    _, flat, rank, size, session = message
    try:
        from fastdeploy_core.config import EngineArgs
        from fastdeploy_core.executor.model_runner import ModelRunner
        from fastdeploy_core.layers.parallel import set_tensor_parallel
        from fastdeploy_core.plugins import load_plugins

        args = EngineArgs.create(**flat)
        pm = load_plugins()
        device_cls = pm.select_device(args.parallel.device)
        collectives = device_cls.tp_collectives(rank, size, session)  # meets the other ranks
        set_tensor_parallel(rank, size, collectives)
        runner = ModelRunner(args, pm)
        info = dict(runner.describe(), collectives=collectives.name,
                    ragged_attention=bool(getattr(runner.ops, "ragged_attention", False)))
        conn.send(("ready", runner.num_blocks, info))
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        traceback.print_exc()
        conn.send(_error(exc))
        return 1
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return 0  # the driver is gone
        kind = message[0]
        try:
            if kind == "step":
                output = runner.execute_model(message[1])
                if rank == 0:
                    conn.send(("output", output))
            elif kind == "blocks":
                runner.resize_kv_cache(message[1])
                conn.send(("sized",))
            elif kind == "close":
                runner.close()
                return 0
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
            traceback.print_exc()
            conn.send(_error(exc))
            return 1


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
