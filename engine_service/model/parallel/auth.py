"""What rank 0 sends its workers is authenticated before anybody unpickles it.

The rendezvous TCPStore serves any local process: a client may list every key
(TCPStore.list_keys), read it and overwrite it, and gloo's connections, whose addresses sit in
that store, are not authenticated either. A key prefix hides nothing there (the listing shows
it), so the secret never goes into the store: rank 0 makes one per engine, hands it to each
worker on a pipe (its stdin, read once at start: never argv, never the environment, which
/proc/<pid>/environ and `ps e` show for the process's life even after os.environ drops it),
and every pickle a rank loads (the worker spec, each step message) carries an HMAC-SHA256
tag under it. The tag covers a label (what the bytes are, and for steps their number, so a
message cannot be replayed or passed off as another). Errors workers report are plain text,
never pickles.
"""

import hashlib
import hmac
import secrets
from typing import BinaryIO

from engine_service.model.parallel.errors import TensorParallelError

TAG_BYTES = 32  # SHA-256
SECRET_HEX_CHARS = 32


def new_secret() -> str:
    return secrets.token_hex(SECRET_HEX_CHARS // 2)


def read_secret(pipe: BinaryIO) -> str | None:
    """The secret rank 0 wrote on `pipe` (one line), or None when there is none (a terminal,
    an empty or closed pipe, or anything that is not a secret new_secret makes)."""
    if pipe.isatty():
        return None
    line = pipe.readline(SECRET_HEX_CHARS + 2).strip().decode(errors="replace")
    if len(line) != SECRET_HEX_CHARS or any(c not in "0123456789abcdef" for c in line):
        return None
    return line


def tag(key: bytes, label: bytes, data: bytes | memoryview) -> bytes:
    mac = hmac.new(key, label, hashlib.sha256)
    mac.update(data)
    return mac.digest()


def seal(key: bytes, label: bytes, data: bytes) -> bytes:
    """The tag, then the data."""
    return tag(key, label, data) + data


def unseal(key: bytes, label: bytes, sealed: bytes) -> bytes:
    """The data, if its tag is right; else TensorParallelError (the data is never used)."""
    data = memoryview(sealed)[TAG_BYTES:]
    check_tag(key, label, data, sealed[:TAG_BYTES])
    return bytes(data)


def check_tag(key: bytes, label: bytes, data: bytes | memoryview, got: bytes) -> None:
    if len(got) != TAG_BYTES or not hmac.compare_digest(tag(key, label, data), got):
        raise TensorParallelError(
            f"tensor-parallel {label[:4].decode(errors='replace')} message failed "
            f"authentication: not from this engine's rank 0 (refused unread)")
