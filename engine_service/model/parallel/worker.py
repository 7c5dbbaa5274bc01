"""A tensor-parallel worker (ranks 1..N-1): `python -m engine_service.model.parallel.worker`.

Started by rank 0 (workers.py) with the rendezvous store's address. It loads its shards, then
runs what rank 0 broadcasts, step by step, until told to stop. Any error ends the process
with status 1 after writing the message, as text, on its report pipe for rank 0's error:
rank 0's next collective fails at once (gloo and NCCL see the closed connection), so the
engine never waits on a dead rank. A worker whose parent is gone exits too: nothing is left
behind when rank 0 is killed.

The engine's secret comes on stdin, a pipe rank 0 writes it to and closes (auth.py says why
not the environment); the spec and every step are checked against it before they are
unpickled. Without it the worker exits 2 at once.
"""

import argparse
import datetime
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback

log = logging.getLogger("engine_service.model.parallel.worker")

PARENT_POLL_S = 0.25
# Fault injection for tests (tests/engine/test_tensor_parallel_phases.py): the worker stops
# itself (SIGSTOP) on reaching this phase, "rendezvous" or "load", for a test to kill it there.
# Only under pytest (PYTEST_CURRENT_TEST, which pytest sets for each test and the workers
# inherit): left in a user's environment it would stall every start for the startup timeout.
STOP_AT_ENV = "PAGEDGEN_TP_TEST_STOP_AT"
UNDER_TEST_ENV = "PYTEST_CURRENT_TEST"


def _phase(name: str) -> None:
    if os.environ.get(STOP_AT_ENV) == name and os.environ.get(UNDER_TEST_ENV):
        os.kill(os.getpid(), signal.SIGSTOP)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the clean way out (main), unless main is stuck
    time.sleep(5.0)
    os._exit(1)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from engine_service.model.parallel.auth import read_secret, unseal

    secret = read_secret(sys.stdin.buffer)
    if not secret:
        print("tensor-parallel worker: no engine secret on stdin; workers are started by "
              "their engine's rank 0, which writes it there", file=sys.stderr)
        return 2
    key = secret.encode()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store", required=True, help="host:port of rank 0's TCPStore")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--report-fd", type=int, default=None,
                        help="a pipe for this worker's error, as text (rank 0 reads it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    # Rank 0 owns the lifecycle, as the serving core does: a Ctrl-C to the process group stops
    # the workers through it (after the front's drain), not under a step. SIGTERM ends a worker
    # as an exception does, between two Python bytecodes: what it holds is let go on the way
    # out (the C++ extension's build lock, taken while the model loads: a worker killed holding
    # it would stall every engine on the machine that loads the extension after it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    if os.environ.get(STOP_AT_ENV) and not os.environ.get(UNDER_TEST_ENV):
        log.warning("%s is set outside a test: ignored", STOP_AT_ENV)

    import torch
    import torch.distributed as dist

    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    try:
        spec = pickle.loads(unseal(key, b"spec", store.get("spec")))
        torch.set_num_threads(spec.threads)
        from engine_service.model.config import load_model_config
        from engine_service.model.parallel.group import connect_group
        from engine_service.model.parallel.rank import RankOf
        from engine_service.model.parallel.shard import plan_shard
        from engine_service.model.parallel.tp_runner import serve_calls
        from engine_service.model.runner import ModelRunner

        config = spec.engine_config
        device = torch.device(f"cuda:{args.rank}" if config.device == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(f"up/{args.rank}", b"1")
        _phase("rendezvous")
        group = connect_group(store, args.rank, args.world_size, device, host, spec.timeout_s)
        _phase("load")
        model_config = load_model_config(config.model)
        runner = ModelRunner(
            model_config, dtype=config.dtype, device=str(device),
            kernel_backend=config.kernel_backend, block_size=config.block_size,
            max_model_len=spec.max_model_len,
            parallel=RankOf(plan_shard(model_config, args.rank, args.world_size), group),
        )
        store.set(f"ready/{args.rank}", b"1")  # rank 0 sends its first call after this
        serve_calls(runner, group, key)
    except BaseException as error:  # noqa: BLE001 (any failure: reported, then exit 1)
        message = f"{type(error).__name__}: {error}"
        traceback.print_exc(file=sys.stderr)
        if args.report_fd is not None:
            try:  # (at most 2000 bytes: within the pipe's buffer, never blocks)
                os.write(args.report_fd, message.encode()[:2000])
            except OSError:  # rank 0 may be gone already
                pass
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # (skip the process groups' destructors: the peers may be gone)


if __name__ == "__main__":
    raise SystemExit(main())
