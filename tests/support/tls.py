"""The test suite's TLS: one development CA per session (trust/certs.py, pagedgen-certs' code)
with a certificate per role, and the channels a test client opens with them.

Services started by the shared fixtures get their role's files (`files("engine")`, ...); a test
talks to them through `channel` / `aio_channel` (mutual TLS with the client certificate, or
the router's / an engine's where the peer authorizes by role) or `end_client_channel` (no
client certificate: a front door's end client). HTTP clients verify `ca_path`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai

from prefix_index.api.client import PrefixIndexClient
from tests.support.index_clients import EngineAndReader
from trust.certs import ensure_ca, ensure_leaf
from trust.credentials import TlsFiles, TlsMaterial, aio_channel, sync_channel
from trust.identity import CLIENT_ROLE, ENGINE_ROLE, ROLES, ROUTER_ROLE

# Roles a session's CA issues at once (engine: one naming no engine id, so any id is its own).
SESSION_ROLES = ROLES


@dataclass(frozen=True)
class SessionCerts:
    folder: Path  # ca.pem, ca-key.pem, <role>.pem, <role>-key.pem (trust/certs_tool.py layout)

    @classmethod
    def make(cls, folder: Path) -> SessionCerts:
        ensure_ca(folder)
        for role in SESSION_ROLES:
            ensure_leaf(folder, role)
        return cls(folder)

    @property
    def ca_path(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def ca(self) -> bytes:
        return self.ca_path.read_bytes()

    def files(self, role: str, engine_id: str | None = None) -> TlsFiles:
        """`role`'s files (an engine certificate naming `engine_id` is made on first use)."""
        issued = ensure_leaf(self.folder, role, engine_id)
        return TlsFiles(issued.cert, issued.key, self.ca_path)

    def material(self, role: str = CLIENT_ROLE) -> TlsMaterial:
        return self.files(role).load()

    def channel(self, target: str, role: str = CLIENT_ROLE, peer_role: str | None = None,
                options=()) -> grpc.Channel:
        """A blocking channel presenting `role`'s certificate (mutual TLS)."""
        return sync_channel(target, self.material(role), peer_role, options)

    def aio_channel(self, target: str, role: str = CLIENT_ROLE, peer_role: str | None = None,
                    options=()) -> grpc.aio.Channel:
        return aio_channel(target, self.material(role), peer_role, options)

    def end_client_channel(self, target: str, options=()) -> grpc.Channel:
        """Server-authenticated TLS, no client certificate (a front door's end client)."""
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(self.ca),
                                   options=list(options))

    def aio_end_client_channel(self, target: str, options=()) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(self.ca),
                                       options=list(options))

    def openai_client(self, base_url: str, api_key: str, **kwargs) -> openai.OpenAI:
        """The official client over HTTPS, verifying the session's CA."""
        return openai.OpenAI(base_url=base_url, api_key=api_key,
                             http_client=openai.DefaultHttpxClient(verify=self.ssl_context()),
                             **kwargs)

    def async_openai_client(self, base_url: str, api_key: str, **kwargs) -> openai.AsyncOpenAI:
        http_client = openai.DefaultAsyncHttpxClient(verify=self.ssl_context())
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client,
                                  **kwargs)

    def index_client(self, target: str, timeout_s: float = 5.0,
                     role: str | None = None) -> PrefixIndexClient:
        """A prefix index client on mutual TLS: as `role` alone (ENGINE_ROLE writes,
        ROUTER_ROLE reads), or by default an engine that reads on a second, router channel
        (tests/support/index_clients.py)."""
        if role is not None:
            return PrefixIndexClient(target, timeout_s, self.material(role))
        return EngineAndReader(target, timeout_s, self.material(ENGINE_ROLE),
                               self.material(ROUTER_ROLE))

    def ssl_context(self, role: str | None = None) -> ssl.SSLContext:
        """Python's TLS trusting the session's CA (urllib, httpx); presenting `role`'s
        certificate when given (an engine's HTTPS port on mutual TLS asks for one)."""
        context = ssl.create_default_context(cafile=str(self.ca_path))
        if role is not None:
            files = self.files(role)
            context.load_cert_chain(str(files.cert), str(files.key))
        return context

