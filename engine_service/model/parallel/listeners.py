"""gloo's listening sockets, closed to new connections once a rank's groups are connected.

A gloo device listens on the rendezvous host for its peers, for the life of the process, and
keeps every connection any local process makes to that port: measured with torch 2.13 on
loopback, 100 connections opened and closed by another client left 100 descriptors open in
the rank, whether they sent nothing, a sequence number, or the same one each time. So any
local user could use up a rank's open-file limit and fail the engine. Nothing in torch's
Python API closes the listener, and shutting the socket down aborts the process (gloo's accept
loop enforces success: "accept: Invalid argument", SIGABRT).

A rank needs no new connection once its groups are made: each gloo group connects its full
mesh in its constructor, and the engine makes no group later. So a classic BPF filter that
drops every packet goes on each of the rank's gloo listening sockets then: a SYN to them is
dropped, no connection is made and no descriptor taken (a client's connect times out); the
connections already made are other sockets and keep working. (The engine's devices are made
eager whatever TORCH_GLOO_LAZY_INIT says: group.py.)

The listeners are found as the TCP sockets of this process in LISTEN that appear while the
device is created (create_device binds its listener before it returns) and whose address the
rank published in the store for its peers to connect to (gloo writes it there as a sockaddr:
family, port, address). Appearing alone is not enough: another thread may open a listener of
its own in that window (~20 ms a device here, most of it reading /proc), and a drop-all
filter on it would black-hole its traffic (seen: a server opened then timed out every
connect). A torch whose gloo publishes addresses otherwise gets no filter, with a warning.
"""

import ctypes
import os
import socket
import struct
from pathlib import Path

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
_TCP_LISTEN = "0A"


class _SockFilter(ctypes.Structure):  # struct sock_filter
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


# BPF_RET | BPF_K, 0: keep 0 bytes of each packet, i.e. drop it. Module-level and immutable:
# the kernel copies the program at attach time, but the pointer must be valid until then.
_DROP_ALL = (_SockFilter * 1)(_SockFilter(0x06, 0, 0, 0))


def _sockaddr(table: str, local_address: str) -> bytes:
    """A /proc/net/tcp{,6} local address ('0100007F:A645': the address as the kernel's 32-bit
    words in host order, then the port) as the start of its sockaddr_in / sockaddr_in6:
    family (host order), port (network order), then for IPv6 flowinfo 0, and the address."""
    address, port = local_address.split(":")
    raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
    if table == "tcp":
        return struct.pack("=H", socket.AF_INET) + struct.pack("!H", int(port, 16)) + raw
    return (struct.pack("=H", socket.AF_INET6) + struct.pack("!H", int(port, 16))
            + b"\0\0\0\0" + raw)


def listening_sockets() -> dict[str, tuple[int, bytes]]:
    """This process's TCP sockets in LISTEN: socket inode -> one of its descriptors and its
    address as a sockaddr's first bytes (none where there is no /proc: not Linux)."""
    if not os.path.isdir("/proc/self/fd"):
        return {}
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            continue
        if target.startswith("socket:["):
            fds[target[8:-1]] = int(name)
    found = {}
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/self/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _TCP_LISTEN and fields[9] in fds:
                found[fields[9]] = (fds[fields[9]], _sockaddr(table, fields[1]))
    return found


def refuse_new_connections(inodes: set[str], published: list[bytes]) -> int:
    """Drop every packet that reaches those of these listening sockets of this process (by
    socket inode) whose address is in one of the `published` values (the rank's own keys in
    the store: see the module docstring). Returns how many it found."""
    fds = [fd for inode, (fd, sockaddr) in listening_sockets().items()
           if inode in inodes and any(sockaddr in value for value in published)]
    program = struct.pack("HL", len(_DROP_ALL), ctypes.addressof(_DROP_ALL))  # sock_fprog
    for fd in fds:
        sock = socket.socket(fileno=os.dup(fd))  # the same socket; closing the dup leaves it
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)
        finally:
            sock.close()
    return len(fds)
