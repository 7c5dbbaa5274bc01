"""A development CA and certificates per role (pagedgen-certs; the stack's secure default).

Every certificate carries, besides the hosts it serves (DNS and IP SANs):
- a URI SAN naming its role, the identity a server reads from a client (trust/identity.py);
- a DNS SAN `<role>.pagedgen.internal`, which a client checks by naming it as the TLS target
  (trust/credentials.py): the router accepts a replica only if it presents an engine's
  certificate, whatever address the replica registered.
Each is usable both to serve and to connect (serverAuth and clientAuth): one process, one
certificate. Keys are EC P-256, written mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from trust.identity import ROLES, identity_uri

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
ROLE_DNS_SUFFIX = ".pagedgen.internal"
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=7)  # a leaf this close to expiry is issued anew


def role_dns_name(role: str) -> str:
    """The DNS SAN every certificate of `role` carries; clients verify it (credentials.py)."""
    return role + ROLE_DNS_SUFFIX


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    written: bool  # False: an existing, still fitting certificate was kept


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)  # (an existing file keeps its mode through O_CREAT)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _load_key(path: Path):
    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _fresh(path: Path) -> x509.Certificate | None:
    """The certificate at `path` if it exists and is not near its expiry."""
    if not path.exists():
        return None
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert if cert.not_valid_after_utc - _now() > RENEW_BEFORE else None


def ensure_ca(out: Path) -> Issued:
    """out/ca.pem and out/ca-key.pem: kept when present (the CA is what peers trust)."""
    cert_path, key_path = out / "ca.pem", out / "ca-key.pem"
    if _fresh(cert_path) is not None and key_path.exists():
        return Issued(cert_path, key_path, False)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagedgen development CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return Issued(cert_path, key_path, True)


def _general_names(role: str, engine_id: str | None, hosts: tuple[str, ...]) -> list:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(role, engine_id)),
                                     x509.DNSName(role_dns_name(role))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def leaf_name(role: str, engine_id: str | None = None) -> str:
    """The files' stem: engine-<id>, engine, router, index, client."""
    return f"{role}-{engine_id}" if engine_id else role


def ensure_leaf(out: Path, role: str, engine_id: str | None = None,
                hosts: tuple[str, ...] = DEFAULT_HOSTS) -> Issued:
    """out/<stem>.pem and out/<stem>-key.pem signed by out/ca.pem (made first if absent); an
    existing one is kept while its CA, names and validity still fit."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    ca = ensure_ca(out)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    stem = leaf_name(role, engine_id)
    cert_path, key_path = out / f"{stem}.pem", out / f"{stem}-key.pem"
    wanted = _general_names(role, engine_id, hosts)
    existing = _fresh(cert_path)
    if existing is not None and key_path.exists() and not ca.written:
        sans = existing.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if existing.issuer == ca_cert.subject and set(sans) == set(wanted):
            return Issued(cert_path, key_path, False)
    key = ec.generate_private_key(ec.SECP256R1())
    ca_key = _load_key(ca.key)
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pagedgen {stem}")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, True, False, True, False, False, False,
                                         False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(wanted), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_cert.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return Issued(cert_path, key_path, True)
