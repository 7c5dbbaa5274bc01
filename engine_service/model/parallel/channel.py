"""Rank 0 -> every worker: one pickled message per step, in one broadcast.

A step's inputs (token ids, positions, slot mapping, block tables, sample rows) plus the block
moves since the last step are pickled and sent in a fixed-size buffer: one broadcast when the
message fits (every decode step of a few hundred sequences does), a second with the rest when
it does not. A fixed first buffer saves the length broadcast that torch's
broadcast_object_list sends ahead of every object.

Pickled rather than packed into one int tensor (measured, bench/README.md "Tensor parallelism
on the CPU"): a 32-sequence decode step pickles in ~13 us to 1.7 kB, packs in ~10 us to 3.6 kB;
both are one broadcast, and the pickle carries the moves and the other calls as they are.

Every message carries an HMAC tag under the engine's secret over its number and bytes
(auth.py says why): a worker unpickles only what this engine's rank 0 sent, in order.
"""

import pickle
import struct
import time

import numpy as np
import torch

from engine_service.model.parallel.auth import TAG_BYTES, check_tag, tag
from engine_service.model.parallel.errors import TensorParallelError
from engine_service.model.parallel.group import TensorParallelGroup

FIRST_BUFFER_BYTES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 30  # a length past it is not rank 0's (checked before allocating)
_LENGTH = 8  # the message's length, int64
_HEADER = _LENGTH + TAG_BYTES


def _label(number: int) -> bytes:
    return b"step" + struct.pack("<q", number)


class StepChannel:
    def __init__(self, group: TensorParallelGroup, key: bytes) -> None:
        self.group = group
        self._key = key
        self._buffer = torch.empty(_HEADER + FIRST_BUFFER_BYTES, dtype=torch.uint8)
        # Rank 0's cost of its messages: pickling, and the broadcasts (bench/tensor_parallel).
        self.pickle_s = 0.0
        self.broadcast_s = 0.0
        self.num_sent = 0
        self.bytes_sent = 0
        # The next message's number, which its tag covers (not num_sent: the benchmark resets
        # that). Sender and receivers count alike.
        self.sequence = 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast_step(tensor)

    def pack(self, message: object) -> bytes:
        """The message as `send_packed` sends it. Nothing is sent: a message that does not
        pickle, or that its receivers would refuse for its size, fails here and leaves the
        workers waiting for the next one as before."""
        start = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.pickle_s += time.perf_counter() - start
        if len(data) > MAX_MESSAGE_BYTES:
            raise TensorParallelError(f"tensor-parallel step message of {len(data)} bytes not "
                                      f"sent: its receivers take at most {MAX_MESSAGE_BYTES}")
        return data

    def send(self, message: object) -> None:
        self.send_packed(self.pack(message))

    def send_packed(self, data: bytes) -> None:
        start = time.perf_counter()
        digest = tag(self._key, _label(self.sequence), data)
        pickled = time.perf_counter()
        view = self._buffer.numpy()
        view[:_LENGTH] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
        view[_LENGTH:_HEADER] = np.frombuffer(digest, dtype=np.uint8)
        first = min(len(data), FIRST_BUFFER_BYTES)
        view[_HEADER : _HEADER + first] = np.frombuffer(data, dtype=np.uint8, count=first)
        self._broadcast(self._buffer)
        if len(data) > first:
            self._broadcast(torch.from_numpy(np.frombuffer(data[first:], dtype=np.uint8).copy()))
        self.pickle_s += pickled - start
        self.broadcast_s += time.perf_counter() - pickled
        self.num_sent += 1
        self.sequence += 1
        self.bytes_sent += len(data)

    def receive(self) -> object:
        self._broadcast(self._buffer)
        view = self._buffer.numpy()
        size = int(view[:_LENGTH].view(np.int64)[0])
        if not 0 <= size <= MAX_MESSAGE_BYTES:
            raise TensorParallelError(f"tensor-parallel step message of {size} bytes refused: "
                                      f"not from this engine's rank 0 (at most "
                                      f"{MAX_MESSAGE_BYTES})")
        first = min(size, FIRST_BUFFER_BYTES)
        data = view[_HEADER : _HEADER + first].tobytes()
        if size > first:
            rest = torch.empty(size - first, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        check_tag(self._key, _label(self.sequence), data, view[_LENGTH:_HEADER].tobytes())
        self.sequence += 1
        return pickle.loads(data)
