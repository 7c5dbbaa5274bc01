"""The gRPC options every pagedgen server binds with (the engine, the router, the index): message
sizes, streams per connection and keepalive enforcement, so that no single connection can make a
server hold an unbounded message, an unbounded number of calls, or answer a ping flood; and how
many connections the server keeps at once and how long one with no call stays open, so that
many clients together cannot take every file descriptor (--max-connections,
--max-connection-idle-s: add_connection_args, one definition for the three servers).

Message sizes are computed from what the server accepts, not guessed: a message past the largest
one a legitimate caller can send is refused by gRPC itself with RESOURCE_EXHAUSTED before it is
parsed ("Received message larger than max"). Each server computes its own bound from its own
limits (generation_message_bytes, apply_message_bytes) and hands it here.
"""

from __future__ import annotations

import argparse
import math
import resource
from dataclasses import dataclass, field

# protobuf's own ceiling for one message: a bound past it means "no bound", so say so.
PROTOBUF_MAX_BYTES = (1 << 31) - 1
UTF8_MAX_BYTES_PER_CHAR = 4
# One field's tag and varint length prefix (a length up to 2^28): at most 1 + 4 bytes, rounded.
FIELD_PREFIX_BYTES = 8
# A varint-encoded int32 / int64 (negative int32 values take 10 bytes: refused anyway, and the
# per-field allowance below covers them for the fields that are not repeated).
INT32_BYTES = 5
INT64_BYTES = 10
DOUBLE_BYTES = 9  # tag + 8
# Everything of a generation request besides its prompt, bounded by the validator's own limits:
# request id (128), cache salt (256 chars), 16 stop strings of 256 chars, 256 stop token ids,
# the sampling scalars; each string at 4 UTF-8 bytes a character. 64 KiB covers it with room.
GENERATION_REQUEST_FIXED_BYTES = 64 << 10
# A connection with no call open this long is sent GOAWAY (gRPC's max_connection_idle). A client
# whose channel is closed so reconnects on its next call without an error, so the limit costs an
# idle client one reconnect; what it frees are the slots (under max_connections) of channels
# opened and forgotten: a notebook's, a crashed tool's pool. Ten minutes is far above any of our
# own clients' quiet spells (a router polls each engine's stats ten times a second, an engine
# heartbeats the index every 10 s, a residency watch is an open call) and than a kubelet's
# probe period, and near what cloud load balancers give an idle connection (350 s to 15 min).
DEFAULT_MAX_CONNECTION_IDLE_S = 600.0
# Connections one server keeps open at once by default: a quarter of the process's open-file
# limit (the engine's and the router's HTTP API may keep half: openai_api/connection_guard.py;
# the rest for the core's pipes, Redis, files), and no more than this. Past it, gRPC closes a
# new connection as soon as it is accepted; the ones open are served as before.
MAX_CONNECTIONS_CAP = 4096


def open_files_share(divisor: int, cap: int) -> int:
    """1/`divisor` of this process's open-file limit, at least 16 and at most `cap`: what one
    kind of connection may take of the descriptors by default."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cap
    return max(16, min(cap, soft // divisor))


def default_max_connections() -> int:
    return open_files_share(4, MAX_CONNECTIONS_CAP)


# (gRPC's default is 20 s: with a write to a frozen client pending, an engine's stop after a
# 30 s drain could run past Kubernetes' 45 s kill grace. A live peer's core acks a ping in
# milliseconds, whatever its Python threads are doing.)
KEEPALIVE_TIMEOUT_MS = 10_000
# How much longer than its drain (--grace-s) a server's stop takes at most when its parts
# answer: the keepalive timeout (above; both fronts stop together), an engine's cut streams'
# second (CUT_SEND_S) and its core's stop (~0.2 s on CPU; a core that hangs is killed after
# 30 s, and a kubelet's SIGKILL ends it the same way). A process manager's kill grace
# (terminationGracePeriodSeconds, compose's stop_grace_period) must exceed a preStop pause +
# --grace-s + this.
STOP_AFTER_DRAIN_S = KEEPALIVE_TIMEOUT_MS / 1000 + 5.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one client connection may hold of a server."""

    max_receive_bytes: int  # the largest request message accepted
    max_send_bytes: int  # the largest reply message sent (-1: no limit)
    # Calls open at once on one connection; more wait in the client's transport until one ends
    # (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS), so one connection cannot open a million calls.
    max_streams_per_connection: int = 1024
    # We ping a connection idle this long and drop it when the ack takes longer than the
    # timeout: a peer that vanished without a TCP reset frees its calls in seconds, not hours.
    # The timeout also bounds a stop: gRPC's stop pings every connection with its GOAWAY and
    # waits for the ack, all of it on a peer that takes no bytes (STOP_AFTER_DRAIN_S).
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS
    # Clients' own pings: at most one per this interval (with or without calls in flight;
    # clients that keep idle channels alive may ping); a client pinging faster is sent GOAWAY
    # after max_ping_strikes such pings, so pings cannot be used to keep a server busy.
    min_client_ping_interval_ms: int = 10_000
    max_ping_strikes: int = 2
    # Connections open at once on the server, all clients together (0: no cap), and how long a
    # connection with no call open stays (0: for good). One server's, not one connection's:
    # every server's own, from its --max-connections and --max-connection-idle-s.
    max_connections: int = field(default_factory=default_max_connections)
    max_connection_idle_s: float = DEFAULT_MAX_CONNECTION_IDLE_S

    def options(self) -> list[tuple[str, int]]:
        server_wide = []
        if self.max_connections > 0:
            # (gRPC core's chttp2 server: a connection accepted past it is closed at once.)
            server_wide.append(("grpc.max_allowed_incoming_connections", self.max_connections))
        if self.max_connection_idle_s > 0:
            server_wide.append(("grpc.max_connection_idle_ms",
                                max(1, round(self.max_connection_idle_s * 1000))))
        return [
            *server_wide,
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # Our keepalive pings go on while a connection stays idle (the default stops them
            # after two pings without data, so an idle dead peer would be noticed late).
            ("grpc.http2.max_pings_without_data", 0),
            # (On a server this is the least interval it accepts between a client's pings.)
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_client_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            # No SO_REUSEPORT: a second process on our port must fail to bind, not share it.
            ("grpc.so_reuseport", 0),
        ]


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--max-connections and --max-connection-idle-s, the same on every gRPC server."""
    p.add_argument("--max-connections", type=int, default=default_max_connections(),
                   help="gRPC connections this server keeps open at once, all clients "
                        "together; one past it is closed as soon as it is accepted (default: a "
                        f"quarter of the open-file limit, at most {MAX_CONNECTIONS_CAP}; "
                        "0: no limit)")
    p.add_argument("--max-connection-idle-s", type=float, default=DEFAULT_MAX_CONNECTION_IDLE_S,
                   help="a gRPC connection with no call open this long is closed (GOAWAY; its "
                        "client reconnects on its next call) (0: no limit)")


def resolve_connection_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """p.error on a bad value: say which, what was expected and what came."""
    if args.max_connections < 0:
        p.error(f"--max-connections must be >= 0 (0: no limit), got {args.max_connections}")
    # (written so that a NaN fails it too)
    if not 0 <= args.max_connection_idle_s < math.inf:
        p.error(f"--max-connection-idle-s must be a finite number >= 0 (0: no limit), got "
                f"{args.max_connection_idle_s}")


def capped(num_bytes: int) -> int:
    return min(num_bytes, PROTOBUF_MAX_BYTES)


def prompt_message_bytes(context_tokens: int, max_chars_per_token: int,
                         max_chat_messages: int, max_role_chars: int = 16) -> int:
    """The largest prompt of a request for a `context_tokens` context: the text (or all the chat
    messages' characters) the validator accepts, every character at 4 UTF-8 bytes, with each
    chat message's own framing; token ids are smaller (5 bytes each at most)."""
    text = UTF8_MAX_BYTES_PER_CHAR * max_chars_per_token * context_tokens
    chat_framing = max_chat_messages * (3 * FIELD_PREFIX_BYTES
                                        + UTF8_MAX_BYTES_PER_CHAR * max_role_chars)
    ids = INT32_BYTES * context_tokens + FIELD_PREFIX_BYTES
    return max(text + chat_framing, ids) + FIELD_PREFIX_BYTES


def output_token_bytes(max_chars_per_token: int, max_logprobs: int) -> int:
    """One generated token in a reply at its largest: its id, its text, and its logprob entry
    with `max_logprobs` alternatives (token id, logprob, framing each)."""
    top = max_logprobs * (FIELD_PREFIX_BYTES + INT32_BYTES + DOUBLE_BYTES)
    entry = FIELD_PREFIX_BYTES + INT32_BYTES + DOUBLE_BYTES + INT32_BYTES + top
    return INT32_BYTES + UTF8_MAX_BYTES_PER_CHAR * max_chars_per_token + entry


def apply_message_bytes(max_ops: int, max_hashes: int, max_chain: int, hash_bytes: int,
                        max_engine_id_chars: int = 128) -> int:
    """The largest request the prefix index accepts: an Apply of `max_ops` ops holding
    `max_hashes` hashes in all (a full re-sync of the largest pool comes in Applies this size),
    or a Lookup of one `max_chain` chain. Every op at its largest fixed part (a commit: hash,
    parent, block id) besides the hashes it lists; each listed hash with its own framing."""
    listed_hash = FIELD_PREFIX_BYTES + hash_bytes
    largest_fixed_op = 3 * FIELD_PREFIX_BYTES + 2 * listed_hash + INT64_BYTES + DOUBLE_BYTES
    header = FIELD_PREFIX_BYTES + max_engine_id_chars + 2 * INT64_BYTES
    apply = header + max_ops * largest_fixed_op + max_hashes * listed_hash
    lookup = FIELD_PREFIX_BYTES + max_chain * listed_hash
    return capped(max(apply, lookup))
