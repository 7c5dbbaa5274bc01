"""Request validation, in one place: proto request -> checked plain data, or an
InvalidRequestError whose message names the field, the value received and what is allowed."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pagedgen_api import prefix_index_pb2 as pb
from prefix_index.api.ops import (
    HASH_BYTES,
    Acquire,
    AcquireKind,
    Commit,
    Evict,
    Forget,
    Op,
    Pin,
    Release,
    SetPinBudget,
    Unpin,
)
from prefix_index.server.config import Limits
from prefix_index.server.errors import InvalidRequestError

# No braces: the id goes inside the Redis Cluster hash tag {engine_id}.
_ENGINE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# host:port, the host a name, an IPv4 address or a bracketed IPv6 one; the port 1..65535
# (checked apart: a router dials what is registered, and port 0 or 70000 dials nothing).
_SERVING_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
MAX_PORT = 65535
MAX_BLOCK_SIZE = 1 << 16
MAX_MODEL_IDENTITY = 1024
MAX_NONCE = 128
MAX_SERVING_ADDRESS = 256
# Sequence numbers travel through Lua, whose numbers are doubles: exact up to 2^53.
MAX_SEQ = 1 << 53


@dataclass(frozen=True, slots=True)
class RegisterArgs:
    engine_id: str
    model_identity: str
    block_size: int
    num_blocks: int
    lease_s: float
    nonce: str = ""
    serving_address: str = ""
    instance_id: str = ""  # what the engine's ModelInfo answers with (crash takeover)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def engine_id(value: str, field: str = "engine_id") -> str:
    if not _ENGINE_ID.fullmatch(value):
        raise InvalidRequestError(
            f"{field}: {_short(value)} is not allowed; expected 1-128 characters of "
            "A-Z a-z 0-9 . _ : -")
    return value


def epoch(value: int) -> int:
    if value <= 0:
        raise InvalidRequestError(f"epoch: {value} is not allowed; pass the epoch that Register "
                                  "returned (a positive number)")
    return value


def hashes(field: str, values: Sequence[bytes], limits: Limits, allow_empty: bool = True,
           chain: bool = False) -> list[bytes]:
    """`chain`: the hashes are one chain, so none repeats (each hashes its parent's hash)."""
    if len(values) > limits.max_chain:
        raise InvalidRequestError(f"{field}: {len(values)} hashes is too many; at most "
                                  f"{limits.max_chain} per op")
    if not values and not allow_empty:
        raise InvalidRequestError(f"{field}: empty; expected at least one {HASH_BYTES}-byte hash")
    for i, value in enumerate(values):
        one_hash(f"{field}[{i}]", value)
    if chain and len(set(values)) != len(values):
        seen: dict[bytes, int] = {}
        for i, value in enumerate(values):
            if value in seen:
                raise InvalidRequestError(f"{field}[{i}]: repeats {field}[{seen[value]}] "
                                          f"({value.hex()}); a chain never repeats a hash")
            seen[value] = i
    return list(values)


def one_hash(field: str, value: bytes) -> bytes:
    if len(value) != HASH_BYTES:
        raise InvalidRequestError(f"{field}: {len(value)} bytes ({value[:20].hex()}); "
                                  f"expected a {HASH_BYTES}-byte block hash")
    return value


def register(request: pb.RegisterRequest, limits: Limits, default_lease_s: float
             ) -> RegisterArgs:
    engine_id(request.engine_id)
    if not request.model_identity or len(request.model_identity) > MAX_MODEL_IDENTITY:
        raise InvalidRequestError(f"model_identity: {_short(request.model_identity)} is not "
                                  f"allowed; expected 1-{MAX_MODEL_IDENTITY} characters")
    if not 1 <= request.block_size <= MAX_BLOCK_SIZE:
        raise InvalidRequestError(f"block_size: {request.block_size} is not allowed; expected "
                                  f"1..{MAX_BLOCK_SIZE} tokens")
    if not 1 <= request.num_blocks <= limits.max_num_blocks:
        raise InvalidRequestError(f"num_blocks: {request.num_blocks} is not allowed; expected "
                                  f"1..{limits.max_num_blocks} (the index's --max-num-blocks)")
    lease_s = request.lease_s or default_lease_s
    if not math.isfinite(lease_s) or not 0.01 <= lease_s <= limits.max_lease_s:
        raise InvalidRequestError(f"lease_s: {request.lease_s} is not allowed; expected 0 (the "
                                  f"default, {default_lease_s}s) or 0.01..{limits.max_lease_s} "
                                  "seconds (the index's --max-lease-s)")
    if len(request.nonce) > MAX_NONCE:
        raise InvalidRequestError(f"nonce: {len(request.nonce)} characters "
                                  f"({_short(request.nonce)}) is too long; at most {MAX_NONCE}")
    if len(request.instance_id) > MAX_NONCE:
        raise InvalidRequestError(f"instance_id: {len(request.instance_id)} characters "
                                  f"({_short(request.instance_id)}) is too long; at most "
                                  f"{MAX_NONCE}")
    address = request.serving_address
    if address:
        matched = len(address) <= MAX_SERVING_ADDRESS and _SERVING_ADDRESS.fullmatch(address)
        if not matched or not 1 <= int(matched.group(2)) <= MAX_PORT:
            raise InvalidRequestError(
                f"serving_address: {_short(address)} is not allowed; expected empty or "
                f"host:port, the port 1..{MAX_PORT} (at most {MAX_SERVING_ADDRESS} characters)")
    return RegisterArgs(request.engine_id, request.model_identity, request.block_size,
                        request.num_blocks, lease_s, request.nonce, address,
                        request.instance_id)


def model_identity_filter(value: str) -> str:
    """Lookup's optional model filter: empty, or what Register accepts as a model identity."""
    if len(value) > MAX_MODEL_IDENTITY:
        raise InvalidRequestError(f"model_identity: {len(value)} characters ({_short(value)}) "
                                  f"is too long; expected empty (any model) or "
                                  f"1-{MAX_MODEL_IDENTITY} characters, as registered")
    return value


def seq(value: int) -> int:
    if value >= MAX_SEQ:
        raise InvalidRequestError(f"seq: {value} is not allowed; expected 0 (unchecked) or "
                                  f"1..{MAX_SEQ - 1}")
    return value


def apply_ops(request: pb.ApplyRequest, limits: Limits) -> list[Op]:
    """The ops of an Apply, checked. Pool-size bounds (block ids, k) are checked by the Lua
    script, which knows the registered pool, before it writes anything."""
    engine_id(request.engine_id)
    epoch(request.epoch)
    seq(request.seq)
    if len(request.ops) > limits.max_ops:
        raise InvalidRequestError(f"ops: {len(request.ops)} ops is too many; at most "
                                  f"{limits.max_ops} per Apply")
    ops: list[Op] = []
    total_hashes = 0
    for i, op in enumerate(request.ops):
        path = f"ops[{i}]"
        kind = op.WhichOneof("kind")
        if kind == "acquire":
            if op.acquire.kind not in AcquireKind.__members__.values():
                raise InvalidRequestError(
                    f"{path}.acquire.kind: {op.acquire.kind} is not allowed; expected "
                    + ", ".join(f"{k.value} ({k.name})" for k in AcquireKind))
            ops.append(Acquire(hashes(f"{path}.acquire.chain", op.acquire.chain, limits,
                                      chain=True), AcquireKind(op.acquire.kind)))
            total_hashes += len(op.acquire.chain)
        elif kind == "commit":
            c = op.commit
            one_hash(f"{path}.commit.hash", c.hash)
            if c.parent:  # empty = the first block of a chain
                one_hash(f"{path}.commit.parent", c.parent)
            if c.block_id < 0:
                raise InvalidRequestError(f"{path}.commit.block_id: {c.block_id} is negative; "
                                          "expected 0..num_blocks-1")
            ops.append(Commit(c.hash, c.parent, c.block_id))
            total_hashes += 2
        elif kind == "release":
            ops.append(Release(hashes(f"{path}.release.hashes", op.release.hashes, limits)))
            total_hashes += len(op.release.hashes)
        elif kind == "evict":
            if op.evict.k < 0:
                raise InvalidRequestError(f"{path}.evict.k: {op.evict.k} is negative; expected "
                                          "0..num_blocks")
            ops.append(Evict(op.evict.k))
        elif kind == "pin":
            ttl_s = op.pin.ttl_s
            if not math.isfinite(ttl_s) or not 0 <= ttl_s <= limits.max_pin_ttl_s:
                raise InvalidRequestError(f"{path}.pin.ttl_s: {ttl_s} is not allowed; expected 0 "
                                          f"(no expiry) or 0..{limits.max_pin_ttl_s:.0f} seconds")
            if op.pin.automatic and ttl_s != 0:
                raise InvalidRequestError(f"{path}.pin.ttl_s: {ttl_s} is not allowed with "
                                          "automatic; expected 0 (an automatic pin cools instead)")
            # A pin is named by its chain's last hash: an empty chain names none.
            ops.append(Pin(hashes(f"{path}.pin.chain", op.pin.chain, limits, allow_empty=False,
                                  chain=True), ttl_s, op.pin.automatic))
            total_hashes += len(op.pin.chain)
        elif kind == "unpin":
            ops.append(Unpin(hashes(f"{path}.unpin.chain", op.unpin.chain, limits,
                                    allow_empty=False), op.unpin.automatic_only))
            total_hashes += len(op.unpin.chain)
        elif kind == "forget":
            f = op.forget
            one_hash(f"{path}.forget.hash", f.hash)
            if f.block_id < 0:
                raise InvalidRequestError(f"{path}.forget.block_id: {f.block_id} is negative; "
                                          "expected 0..num_blocks-1")
            ops.append(Forget(f.hash, f.block_id))
            total_hashes += 1
        elif kind == "set_pin_budget":
            # (uint32: never negative; the script checks it against the registered pool.)
            ops.append(SetPinBudget(op.set_pin_budget.blocks))
        else:
            raise InvalidRequestError(f"{path}: no op set; expected one of acquire, commit, "
                                      "release, evict, pin, unpin, forget, set_pin_budget")
        if total_hashes > limits.max_hashes:
            raise InvalidRequestError(f"ops: more than {limits.max_hashes} hashes in one Apply "
                                      f"(passed at {path})")
    return ops
