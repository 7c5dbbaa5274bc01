"""Rank 0 and rank 1 of a real gloo tensor-parallel group in two threads of one process, each
with its step channel: for tests of what travels between ranks."""

import datetime
import threading

import torch
import torch.distributed as dist

from engine_service.model.parallel.channel import StepChannel
from engine_service.model.parallel.group import connect_group


def two_channels(keys: tuple[bytes, bytes], timeout_s: float = 30.0):
    """(store, [rank 0's channel, rank 1's]). Each rank has its own connection to the store:
    one TCPStore object serves one call at a time, and rank 0's wait for rank 1's address
    would hold it while rank 1 waits to write that address (a deadlock that never times out).
    Keep the store referenced as long as the channels."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    stores = [store, dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=30))]
    groups: list = [None, None]

    def connect(rank: int) -> None:
        groups[rank] = connect_group(stores[rank], rank, 2, torch.device("cpu"), "127.0.0.1",
                                     timeout_s)

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stores, [StepChannel(groups[rank], keys[rank]) for rank in (0, 1)]
