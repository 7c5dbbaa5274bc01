from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcquireKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACQUIRE_KIND_ADMISSION: _ClassVar[AcquireKind]
    ACQUIRE_KIND_FORK: _ClassVar[AcquireKind]
    ACQUIRE_KIND_RESYNC: _ClassVar[AcquireKind]

class OpStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_STATUS_OK: _ClassVar[OpStatus]
    OP_STATUS_NOT_HELD: _ClassVar[OpStatus]
    OP_STATUS_REFCOUNT_ZERO: _ClassVar[OpStatus]
    OP_STATUS_BLOCK_IN_USE: _ClassVar[OpStatus]
    OP_STATUS_HASH_EXISTS: _ClassVar[OpStatus]
    OP_STATUS_ALREADY_COMMITTED: _ClassVar[OpStatus]
    OP_STATUS_PIN_BUDGET_EXCEEDED: _ClassVar[OpStatus]
    OP_STATUS_BLOCK_MISMATCH: _ClassVar[OpStatus]

class PinState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_STATE_NONE: _ClassVar[PinState]
    PIN_STATE_EXPLICIT: _ClassVar[PinState]
    PIN_STATE_AUTOMATIC: _ClassVar[PinState]
ACQUIRE_KIND_ADMISSION: AcquireKind
ACQUIRE_KIND_FORK: AcquireKind
ACQUIRE_KIND_RESYNC: AcquireKind
OP_STATUS_OK: OpStatus
OP_STATUS_NOT_HELD: OpStatus
OP_STATUS_REFCOUNT_ZERO: OpStatus
OP_STATUS_BLOCK_IN_USE: OpStatus
OP_STATUS_HASH_EXISTS: OpStatus
OP_STATUS_ALREADY_COMMITTED: OpStatus
OP_STATUS_PIN_BUDGET_EXCEEDED: OpStatus
OP_STATUS_BLOCK_MISMATCH: OpStatus
PIN_STATE_NONE: PinState
PIN_STATE_EXPLICIT: PinState
PIN_STATE_AUTOMATIC: PinState

class RegisterRequest(_message.Message):
    __slots__ = ("engine_id", "model_identity", "block_size", "num_blocks", "lease_s", "nonce", "serving_address", "instance_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SERVING_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model_identity: str
    block_size: int
    num_blocks: int
    lease_s: float
    nonce: str
    serving_address: str
    instance_id: str
    def __init__(self, engine_id: _Optional[str] = ..., model_identity: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lease_s: _Optional[float] = ..., nonce: _Optional[str] = ..., serving_address: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("epoch", "lease_s", "pin_budget")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_s: float
    pin_budget: int
    def __init__(self, epoch: _Optional[int] = ..., lease_s: _Optional[float] = ..., pin_budget: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "epoch")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class AcquireOp(_message.Message):
    __slots__ = ("chain", "kind")
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedScalarFieldContainer[bytes]
    kind: AcquireKind
    def __init__(self, chain: _Optional[_Iterable[bytes]] = ..., kind: _Optional[_Union[AcquireKind, str]] = ...) -> None: ...

class CommitOp(_message.Message):
    __slots__ = ("hash", "parent", "block_id")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    parent: bytes
    block_id: int
    def __init__(self, hash: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., block_id: _Optional[int] = ...) -> None: ...

class ReleaseOp(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictOp(_message.Message):
    __slots__ = ("k",)
    K_FIELD_NUMBER: _ClassVar[int]
    k: int
    def __init__(self, k: _Optional[int] = ...) -> None: ...

class PinOp(_message.Message):
    __slots__ = ("chain", "ttl_s", "automatic")
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    automatic: bool
    def __init__(self, chain: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ..., automatic: _Optional[bool] = ...) -> None: ...

class UnpinOp(_message.Message):
    __slots__ = ("chain", "automatic_only")
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_ONLY_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedScalarFieldContainer[bytes]
    automatic_only: bool
    def __init__(self, chain: _Optional[_Iterable[bytes]] = ..., automatic_only: _Optional[bool] = ...) -> None: ...

class ForgetOp(_message.Message):
    __slots__ = ("hash", "block_id")
    HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    block_id: int
    def __init__(self, hash: _Optional[bytes] = ..., block_id: _Optional[int] = ...) -> None: ...

class SetPinBudgetOp(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("acquire", "commit", "release", "evict", "pin", "unpin", "forget", "set_pin_budget")
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    FORGET_FIELD_NUMBER: _ClassVar[int]
    SET_PIN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    acquire: AcquireOp
    commit: CommitOp
    release: ReleaseOp
    evict: EvictOp
    pin: PinOp
    unpin: UnpinOp
    forget: ForgetOp
    set_pin_budget: SetPinBudgetOp
    def __init__(self, acquire: _Optional[_Union[AcquireOp, _Mapping]] = ..., commit: _Optional[_Union[CommitOp, _Mapping]] = ..., release: _Optional[_Union[ReleaseOp, _Mapping]] = ..., evict: _Optional[_Union[EvictOp, _Mapping]] = ..., pin: _Optional[_Union[PinOp, _Mapping]] = ..., unpin: _Optional[_Union[UnpinOp, _Mapping]] = ..., forget: _Optional[_Union[ForgetOp, _Mapping]] = ..., set_pin_budget: _Optional[_Union[SetPinBudgetOp, _Mapping]] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("engine_id", "epoch", "ops", "seq")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    seq: int
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., seq: _Optional[int] = ...) -> None: ...

class EvictedBlock(_message.Message):
    __slots__ = ("hash", "block_id")
    HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    block_id: int
    def __init__(self, hash: _Optional[bytes] = ..., block_id: _Optional[int] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("status", "detail", "block_ids", "evicted", "count")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    status: OpStatus
    detail: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedCompositeFieldContainer[EvictedBlock]
    count: int
    def __init__(self, status: _Optional[_Union[OpStatus, str]] = ..., detail: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[_Union[EvictedBlock, _Mapping]]] = ..., count: _Optional[int] = ...) -> None: ...

class PinChange(_message.Message):
    __slots__ = ("hash", "block_id", "state")
    HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    block_id: int
    state: PinState
    def __init__(self, hash: _Optional[bytes] = ..., block_id: _Optional[int] = ..., state: _Optional[_Union[PinState, str]] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("results", "pin_changes", "replayed")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PIN_CHANGES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[OpResult]
    pin_changes: _containers.RepeatedCompositeFieldContainer[PinChange]
    replayed: bool
    def __init__(self, results: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ..., pin_changes: _Optional[_Iterable[_Union[PinChange, _Mapping]]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("chain", "model_identity")
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedScalarFieldContainer[bytes]
    model_identity: str
    def __init__(self, chain: _Optional[_Iterable[bytes]] = ..., model_identity: _Optional[str] = ...) -> None: ...

class EngineMatch(_message.Message):
    __slots__ = ("engine_id", "matched_blocks", "num_blocks", "held_blocks", "evictable_blocks")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    matched_blocks: int
    num_blocks: int
    held_blocks: int
    evictable_blocks: int
    def __init__(self, engine_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., held_blocks: _Optional[int] = ..., evictable_blocks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineMatch]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineMatch, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine_id", "epoch", "model_identity", "block_size", "num_blocks", "blocks", "evictable", "pinned", "auto_pinned", "pin_budget", "queries", "hits", "evictions", "lease_remaining_s", "forgets", "history", "serving_address")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    AUTO_PINNED_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    FORGETS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    SERVING_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    model_identity: str
    block_size: int
    num_blocks: int
    blocks: int
    evictable: int
    pinned: int
    auto_pinned: int
    pin_budget: int
    queries: int
    hits: int
    evictions: int
    lease_remaining_s: float
    forgets: int
    history: int
    serving_address: str
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., model_identity: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., blocks: _Optional[int] = ..., evictable: _Optional[int] = ..., pinned: _Optional[int] = ..., auto_pinned: _Optional[int] = ..., pin_budget: _Optional[int] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., forgets: _Optional[int] = ..., history: _Optional[int] = ..., serving_address: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ...) -> None: ...

class WatchResidencyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResidencyEvent(_message.Message):
    __slots__ = ("engine_id", "epoch", "reset", "model_identity", "added", "removed", "synced", "heartbeat")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    reset: bool
    model_identity: str
    added: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    synced: bool
    heartbeat: bool
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reset: _Optional[bool] = ..., model_identity: _Optional[str] = ..., added: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., synced: _Optional[bool] = ..., heartbeat: _Optional[bool] = ...) -> None: ...
