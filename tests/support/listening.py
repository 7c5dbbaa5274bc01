"""Which local addresses listen on a TCP port, read from /proc/net/tcp and tcp6."""

import ipaddress
from pathlib import Path

_LISTEN = "0A"


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # The kernel writes each 32-bit word in host order (little-endian here).
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_addresses(port: int) -> set[str]:
    """Every address with a socket in LISTEN on `port` ('0.0.0.0' or '::': all interfaces)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            hex_ip, hex_port = fields[1].split(":")
            if fields[3] == _LISTEN and int(hex_port, 16) == port:
                found.add(_address(hex_ip))
    return found


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


