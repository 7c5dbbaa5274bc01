"""The prefix index over mutual TLS authorizes by the caller's certificate: engines write only
their own engine ids, routers only read, no certificate is UNAUTHENTICATED (issue 32)."""

from __future__ import annotations

import datetime
import uuid

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from tests.trust.conftest import files, make_certs
from trust.credentials import TlsMaterial, channel_options

MODEL = "tiny-model@1"


def stub(index, tls: TlsMaterial | None, server_only: bool = False) -> pb_grpc.PrefixIndexStub:
    """A stub presenting `tls`'s certificate (server_only: none, the CA alone; tls None: plain
    text)."""
    if tls is None:
        channel = grpc.insecure_channel(index.target)
    else:
        credentials = (grpc.ssl_channel_credentials(tls.ca) if server_only
                       else tls.channel_credentials())
        channel = grpc.secure_channel(index.target, credentials, options=channel_options("index"))
    return pb_grpc.PrefixIndexStub(channel)


def register(s, engine_id: str, nonce: str = "") -> int:
    return s.Register(pb.RegisterRequest(engine_id=engine_id, model_identity=MODEL, block_size=16,
                                         num_blocks=64, lease_s=30, nonce=nonce),
                      timeout=10).epoch


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


def forget_request(engine_id: str, epoch: int) -> pb.ApplyRequest:
    op = pb.Op(forget=pb.ForgetOp(hash=b"\x01" * 16, block_id=0))
    return pb.ApplyRequest(engine_id=engine_id, epoch=epoch, ops=[op])


def test_an_engine_registers_applies_and_a_router_reads(tls_index, certs):
    engine = stub(tls_index, files(certs, "engine-engine-a").load())
    router = stub(tls_index, files(certs, "router").load())
    epoch = register(engine, "engine-a", nonce=uuid.uuid4().hex)
    engine.Heartbeat(pb.HeartbeatRequest(engine_id="engine-a", epoch=epoch), timeout=10)
    engine.Apply(pb.ApplyRequest(engine_id="engine-a", epoch=epoch, ops=[
        pb.Op(acquire=pb.AcquireOp(chain=[b"\x02" * 16]))]), timeout=10)
    stats = router.Stats(pb.StatsRequest(engine_id="engine-a"), timeout=10)
    assert stats.engines[0].epoch == epoch
    router.Lookup(pb.LookupRequest(chain=[b"\x02" * 16], model_identity=MODEL), timeout=10)


def test_no_certificate_or_plain_text_is_refused(tls_index, certs):
    ca_only = stub(tls_index, files(certs, "router").load(), server_only=True)
    # grpcio closes the handshake of a client with no certificate: the call never arrives.
    assert code_of(lambda: register(ca_only, "rogue")) in (grpc.StatusCode.UNAVAILABLE,
                                                            grpc.StatusCode.UNAUTHENTICATED)
    plain = stub(tls_index, None)
    assert code_of(lambda: plain.Stats(pb.StatsRequest(), timeout=5)) == \
        grpc.StatusCode.UNAVAILABLE
    assert code_of(lambda: register(plain, "rogue")) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("stem", ["router", "client", "index"])
def test_only_engines_register(tls_index, certs, stem):
    s = stub(tls_index, files(certs, stem).load())
    assert code_of(lambda: register(s, f"rogue-{stem}")) == grpc.StatusCode.PERMISSION_DENIED


def test_routers_cannot_write_and_engines_cannot_read(tls_index, certs):
    engine = stub(tls_index, files(certs, "engine-engine-b").load())
    epoch = register(engine, "engine-b", nonce=uuid.uuid4().hex)
    router = stub(tls_index, files(certs, "router").load())
    assert code_of(lambda: router.Apply(forget_request("engine-b", epoch), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: router.Heartbeat(pb.HeartbeatRequest(engine_id="engine-b",
                                                                epoch=epoch), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: engine.Stats(pb.StatsRequest(), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: engine.Lookup(pb.LookupRequest(chain=[b"\x02" * 16]), timeout=10)) \
        == grpc.StatusCode.PERMISSION_DENIED
    client = stub(tls_index, files(certs, "client").load())
    assert code_of(lambda: client.Stats(pb.StatsRequest(), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED


def test_a_foreign_engine_certificate_cannot_touch_another_id(tls_index, certs):
    """With the victim's epoch read from Stats (as a router may), another engine's certificate
    can neither Apply (a ForgetOp included), Heartbeat nor re-register the id; the victim goes
    on as before."""
    victim = stub(tls_index, files(certs, "engine-engine-c").load())
    epoch = register(victim, "engine-c", nonce="victim")
    router = stub(tls_index, files(certs, "router").load())
    read = router.Stats(pb.StatsRequest(engine_id="engine-c"), timeout=10).engines[0].epoch
    assert read == epoch
    for stem in ("engine-engine-b", "engine"):  # one naming another id, one naming none
        rogue = stub(tls_index, files(certs, stem).load())
        assert code_of(lambda r=rogue: r.Apply(forget_request("engine-c", read), timeout=10)) \
            == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda r=rogue: r.Heartbeat(
            pb.HeartbeatRequest(engine_id="engine-c", epoch=read), timeout=10)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda r=rogue: register(r, "engine-c", nonce="victim")) in (
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS)
    victim.Heartbeat(pb.HeartbeatRequest(engine_id="engine-c", epoch=epoch), timeout=10)
    assert router.Stats(pb.StatsRequest(engine_id="engine-c"), timeout=10).engines[0].epoch \
        == epoch


def test_certificates_naming_no_id_own_what_they_registered(tls_index, certs, tmp_path):
    """Two engine certificates naming no id: each acts on the ids it registered, not on the
    other's (the principal is the certificate)."""
    first = stub(tls_index, files(certs, "engine").load())
    engine_id = f"anon-{uuid.uuid4().hex[:8]}"
    epoch = register(first, engine_id, nonce="n1")
    first.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id, epoch=epoch), timeout=10)
    # A second no-id certificate of the same CA.
    for name in ("ca.pem", "ca-key.pem"):
        (tmp_path / name).write_bytes((certs / name).read_bytes())
    make_certs(tmp_path, "--engine", "")
    second = stub(tls_index, files(tmp_path, "engine").load())
    assert code_of(lambda: second.Apply(forget_request(engine_id, epoch), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: register(second, engine_id, nonce="n1")) == \
        grpc.StatusCode.ALREADY_EXISTS
    first.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id, epoch=epoch), timeout=10)


def test_a_certificate_naming_no_role_is_unauthenticated(tls_index, certs, tmp_path):
    """Signed by the CA (so the handshake passes) but with no pagedgen identity in it."""
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca-key.pem").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nobody")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    tls = TlsMaterial(cert.public_bytes(serialization.Encoding.PEM),
                      key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()),
                      (certs / "ca.pem").read_bytes())
    s = stub(tls_index, tls)
    assert code_of(lambda: register(s, "nobody")) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: s.Stats(pb.StatsRequest(), timeout=10)) == \
        grpc.StatusCode.UNAUTHENTICATED
