"""The tensor-parallel rendezvous is no way in for other local processes (issue 33).

Rank 0's TCPStore listens on loopback with no authentication, and any client may list its
keys (TCPStore.list_keys) and read or overwrite any of them; gloo's own connections are not
authenticated either. So nothing a worker unpickles may come from there unchecked: rank 0
makes a random secret per engine, hands it to its workers on their stdin (never their
arguments, their environment or the store), and tags the worker spec and every step message with an
HMAC under it; a worker refuses, unread, whatever does not carry the tag. Errors travel as
text. Real processes and real gloo groups throughout.
"""

import datetime
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from engine_service import LLM, SamplingParams
from engine_service.model.parallel.channel import StepChannel
from engine_service.model.parallel.errors import TensorParallelError
from engine_service.model.parallel.launch import environ_set, nccl_environment, nccl_store_users
from engine_service.model.parallel.worker import STOP_AT_ENV
from engine_service.model.parallel.workers import Workers, serve_store
from tests.service.test_engine_death import child_pids
from tests.support.gloo_pair import two_channels
from tests.support.listening import listening_addresses
from tests.support.process_state import process_state, wait_until

WORKER_MODULE = b"engine_service.model.parallel.worker"
DEADLINE_S = 120.0  # generous: engine start-ups on a loaded 2-core machine

WORKER = [sys.executable, "-m", "engine_service.model.parallel.worker"]


class _Touch:
    """Unpickling this creates `path`: proof that a pickle from outside was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _server_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


@pytest.mark.parametrize("stdin", ["", "short\n", "g" * 32 + "\n"])
def test_a_worker_started_without_the_secret_exits_2_naming_it(stdin):
    run = subprocess.run([*WORKER, "--rank", "1", "--world-size", "2",
                          "--store", "127.0.0.1:1", "--parent-pid", str(os.getpid())],
                         input=stdin, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "no engine secret on stdin" in run.stderr


def test_a_spec_planted_in_the_store_is_refused_unread(tmp_path):
    """An outsider who got to the store first (or overwrote the key) gets nothing run: the
    worker checks the spec's tag before it unpickles."""
    store = _server_store()
    planted = tmp_path / "planted"
    try:
        store.set("spec", b"\0" * 32 + pickle.dumps(_Touch(planted)))
        read_end, write_end = os.pipe()
        run = subprocess.run([*WORKER, "--rank", "1", "--world-size", "2",
                              "--store", f"127.0.0.1:{store.port}",
                              "--parent-pid", str(os.getpid()), "--report-fd", str(write_end)],
                             input="0" * 32 + "\n", capture_output=True, text=True,
                             timeout=120, pass_fds=(write_end,))
        os.close(write_end)
        assert run.returncode == 1, run.stderr
        assert "authentic" in run.stderr
        assert not planted.exists(), "the worker unpickled a planted spec"
        # Its error reaches rank 0 as text on its report pipe, not as a pickle.
        with os.fdopen(read_end, "rb") as report:
            assert "authentic" in report.read().decode()
    finally:
        del store


def _exchange(sender: StepChannel, receiver: StepChannel, message: object):
    """Send on one thread, receive on this one: what the receiver got, or its error."""
    thread = threading.Thread(target=sender.send, args=(message,))
    thread.start()
    try:
        return receiver.receive()
    except TensorParallelError as error:
        return error
    finally:
        thread.join()


def test_a_step_message_under_another_secret_is_refused_unread(tmp_path):
    """A peer that is not rank 0 (it took a rank's place in the rendezvous, or wrote to a
    worker's socket) cannot make a worker load its pickle."""
    planted = tmp_path / "planted"
    store, (rank0, rank1) = two_channels((b"a" * 32, b"b" * 32))
    try:
        got = _exchange(rank0, rank1, _Touch(planted))
        assert isinstance(got, TensorParallelError) and "authentic" in str(got)
        assert not planted.exists(), "a worker unpickled a step it could not authenticate"
    finally:
        del rank0, rank1, store


def test_step_messages_under_the_secret_arrive_and_a_replay_is_refused():
    store, (rank0, rank1) = two_channels((b"k" * 32, b"k" * 32))
    try:
        big = list(range(40_000))  # past the first buffer: a second broadcast
        assert _exchange(rank0, rank1, {"step": 1}) == {"step": 1}
        assert _exchange(rank0, rank1, big) == big
        # The same bytes again are the wrong step: each tag covers the message's number.
        rank0.sequence -= 1
        got = _exchange(rank0, rank1, {"step": 1})
        assert isinstance(got, TensorParallelError) and "authentic" in str(got)
    finally:
        del rank0, rank1, store


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _store_seen_while_a_worker_loads(worker: int) -> dict[str, bytes]:
    """Every key and value of the rendezvous store, read as an outsider would."""
    argv = _cmdline(worker).split(b"\0")
    port = int(argv[argv.index(b"--store") + 1].rsplit(b":", 1)[1])
    outsider = dist.TCPStore("127.0.0.1", port, is_master=False,
                             timeout=datetime.timedelta(seconds=30))
    try:
        return {key: outsider.get(key) for key in outsider.list_keys()}
    finally:
        del outsider


def test_the_secret_is_in_no_key_no_value_no_command_line_and_no_environment(tiny_llama_dir,
                                                                              monkeypatch):
    """The store is read while it is open (it closes once the ranks are ready): with the
    worker stopped at its load by the test hook, then let go."""
    monkeypatch.setenv(STOP_AT_ENV, "load")
    started: list = []
    thread = threading.Thread(target=lambda: started.append(
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32)),
        daemon=True)
    thread.start()
    found: list[int] = []
    wait_until(lambda: found.extend(child_pids(os.getpid(), WORKER_MODULE)) or found,
               "started a worker", DEADLINE_S)
    worker = found[0]
    wait_until(lambda: process_state(worker) == "T", "stopped at load", DEADLINE_S)
    try:
        seen = _store_seen_while_a_worker_loads(worker)
    finally:
        os.kill(worker, signal.SIGCONT)
    thread.join(DEADLINE_S)
    assert started, "the engine did not start once its worker went on"
    llm = started[0]
    try:
        workers = llm.llm_engine.runner.workers
        secret = workers.secret.encode()
        assert "spec" in seen
        for key, value in seen.items():
            assert secret not in key.encode(), key
            assert secret not in value, key
        for pid in [os.getpid(), *(p.pid for p in workers.procs)]:
            assert secret not in _cmdline(pid)
            # A process's initial environment stays readable in /proc (and `ps e`) after
            # os.environ drops a variable: the secret must never have been there.
            assert secret not in Path(f"/proc/{pid}/environ").read_bytes(), pid

        out = llm.generate("The capital of France is", SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_the_store_listens_on_the_rendezvous_host_only():
    """The rendezvous binds to loopback unless told otherwise: its TCPStore too, not only
    gloo's connections. (torch's TCPStore server binds every interface whatever host it is
    given: the store was open to the network, spec and keys for anyone to read or delete.)"""
    store = serve_store("127.0.0.1", 0)
    try:
        assert listening_addresses(store.port) == {"127.0.0.1"}
    finally:
        del store


@pytest.mark.parametrize("nccl_env", [{}, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}])
def test_the_store_is_closed_once_every_rank_is_ready(nccl_env, tiny_llama_dir, monkeypatch):
    """The store takes any local client's keys, 8 MiB a value and no bound on their number,
    into rank 0's memory (seen: 60 sets from another process grew it by 470 MiB): open for
    the engine's life, it let any local process exhaust the engine's memory. Its job ends
    with the rendezvous, so it closes then; a worker's error reaches rank 0 on a pipe. On the
    CPU whatever the NCCL settings (they keep it open on CUDA only: launch.py)."""
    for name, value in nccl_env.items():
        monkeypatch.setenv(name, value)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32)
    try:
        workers = llm.llm_engine.runner.workers
        assert listening_addresses(workers.store_port) == set()
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()


def test_the_nccl_features_that_use_the_store_are_named():
    """On CUDA the store closes after the start unless an NCCL feature set in the environment
    still talks through it (launch.nccl_store_users): then it stays open, with a warning
    naming the feature. TORCH_NCCL_DUMP_ON_TIMEOUT, on by torch's default, is set to 0 for
    the ranks unless the user set it (launch.nccl_environment)."""
    assert nccl_store_users({}) == []
    assert nccl_store_users({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                             "TORCH_NCCL_PROPAGATE_ERROR": "False",
                             "TORCH_NCCL_DESYNC_DEBUG": "", "TORCH_DISTRIBUTED_DEBUG": "INFO",
                             "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}) == []
    assert nccl_store_users({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}) == [
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1"]
    assert nccl_store_users({"TORCH_NCCL_PROPAGATE_ERROR": "true",
                             "TORCH_NCCL_DESYNC_DEBUG": "maybe",
                             "TORCH_DISTRIBUTED_DEBUG": "detail"}) == [
        "TORCH_NCCL_PROPAGATE_ERROR=true", "TORCH_NCCL_DESYNC_DEBUG=maybe",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL"]


DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def test_the_nccl_dump_setting_reaches_the_ranks_and_leaves_the_process_as_it_was(monkeypatch):
    """On CUDA the flight recorder's dump (it talks through the store, which closes) is
    turned off for the engine's ranks unless the user set it: in the workers' environment,
    and in rank 0's only while its group is made (environ_set). It was set in os.environ for
    good, so an offline LLM turned it off for the user's own NCCL groups made later in the
    process. (The CUDA start itself needs two GPUs; these are its parts.)"""
    monkeypatch.delenv(DUMP, raising=False)
    assert nccl_environment("cuda", os.environ) == {DUMP: "0"}
    assert nccl_environment("cuda", {DUMP: "1"}) == {}
    assert nccl_environment("cpu", os.environ) == {}
    with environ_set({DUMP: "0"}):
        assert os.environ[DUMP] == "0"
    assert DUMP not in os.environ
    monkeypatch.setenv(DUMP, "1")
    with pytest.raises(KeyError), environ_set({DUMP: "0"}):
        raise KeyError("the start failed")
    assert os.environ[DUMP] == "1"
    monkeypatch.delenv(DUMP)
    # A worker's environment has it (read in /proc while the worker is stopped), ours not.
    workers = Workers(SimpleNamespace(threads=1), 2, "127.0.0.1", 0, extra_env={DUMP: "0"})
    try:
        worker = workers.procs[0].pid
        os.kill(worker, signal.SIGSTOP)
        # Popen returns once exec closed its pipe, before the kernel has laid out the new
        # environment (/proc's environ reads empty until then, as a run under load saw); the
        # stop takes hold on the way back to user space, after it.
        wait_until(lambda: process_state(worker) == "T", "the worker stopped", 30)
        environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        assert f"{DUMP}=0".encode() in environ
        assert DUMP not in os.environ
    finally:
        workers.kill()


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its sockets' inodes in its net/tcp tables)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_gloo_listeners_take_no_connection_after_the_start(host, tiny_llama_dir, monkeypatch):
    """gloo keeps every connection made to a rank's listening ports open for the process's
    life (measured: 100 connections opened and closed by a client, 100 descriptors kept), so
    any local process could use up a rank's open-file limit. Once the groups are connected
    their listeners drop every packet (listeners.py): a client's connect times out and takes
    no descriptor in either rank, and the engine still generates. On IPv6 too."""
    monkeypatch.setenv("PAGEDGEN_TP_HOST", host)
    ours_before = _listening_ports(os.getpid())
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32)
    try:
        worker = llm.llm_engine.runner.workers.procs[0].pid
        ports = {os.getpid(): _listening_ports(os.getpid()) - ours_before,
                 worker: _listening_ports(worker)}
        assert [len(p) for p in ports.values()] == [2, 2], ports  # a control, a compute device
        open_files = {pid: _open_files(pid) for pid in ports}
        for pid_ports in ports.values():
            for port in pid_ports:
                for _ in range(3):
                    with pytest.raises(TimeoutError):
                        socket.create_connection((host, port), timeout=0.3).close()
        assert {pid: _open_files(pid) for pid in ports} == open_files
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()


def test_the_groups_connect_at_the_start_under_torch_gloo_lazy_init(tiny_llama_dir,
                                                                     monkeypatch):
    """TORCH_GLOO_LAZY_INIT (set for a user's own gloo jobs) would connect the engine's pairs
    at their first use, through the store, which closes after the start: the first call
    failed ('tensor-parallel collective failed: Failed to recv, got 0 bytes'), and the
    listeners stayed open. The engine's devices are made eager whatever it says."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    ours_before = _listening_ports(os.getpid())
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32)
    try:
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
        worker = llm.llm_engine.runner.workers.procs[0].pid
        for port in (_listening_ports(os.getpid()) - ours_before) | _listening_ports(worker):
            with pytest.raises(TimeoutError):
                socket.create_connection(("127.0.0.1", port), timeout=0.3).close()
    finally:
        llm.close()


def test_a_listener_another_thread_opens_while_gloo_starts_keeps_its_traffic(tiny_llama_dir,
                                                                            monkeypatch):
    """The filter goes on the listeners that appear while a gloo device is made *and* whose
    address the rank published for gloo: a server the user's process opens in that window
    (here, inside create_device, as another thread could) is not gloo's and keeps taking
    connections (it timed out every connect before), while gloo's still refuse."""
    create = dist.ProcessGroupGloo.create_device
    servers: list[socket.socket] = []

    def create_while_a_server_opens(*args, **kwargs):
        device = create(*args, **kwargs)
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        servers.append(server)
        return device

    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device",
                        staticmethod(create_while_a_server_opens))
    ours_before = _listening_ports(os.getpid())
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32)
    try:
        assert len(servers) == 2  # a control, a compute device
        server_ports = {server.getsockname()[1] for server in servers}
        gloo_ports = _listening_ports(os.getpid()) - ours_before - server_ports
        assert len(gloo_ports) == 2, gloo_ports
        for server in servers:
            socket.create_connection(server.getsockname(), timeout=DEADLINE_S).close()
        for port in gloo_ports:
            with pytest.raises(TimeoutError):
                socket.create_connection(("127.0.0.1", port), timeout=0.3).close()
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()
        for server in servers:
            server.close()
