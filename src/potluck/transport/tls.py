"""TLS for the pool: each worker's self-signed certificate, pinned through the pool secret.

A worker started with `--tls` makes an EC P-256 key and a self-signed certificate once and keeps
them in `<config dir>/tls/` (key mode 0600). A head (or an upstream worker) fetches the
certificate the node presents, opens its gRPC channel trusting exactly that certificate, and then
both sides put the certificate's sha256 into their HMAC proofs (transport/auth.py). A machine in
between that shows its own certificate therefore cannot complete the handshake without the pool
secret: the secret pins every worker's certificate, with no certificate authority and no
trust-on-first-use file to keep.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from potluck.errors import PotluckError
from potluck.files import locked, private_tmp

SERVER_NAME = "potluck-worker"  # the name in every worker certificate; clients check this name
CERT_DAYS = 3650


class TlsError(PotluckError):
    """A certificate that cannot be made, read or fetched, or a node that does not speak TLS."""


@dataclass(frozen=True)
class TlsIdentity:
    """A worker's key and certificate (PEM) and the certificate's sha256 (of its DER bytes)."""

    key_pem: bytes = field(repr=False)
    cert_pem: bytes
    sha256: bytes


def _der_sha256(cert_pem: bytes) -> bytes:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_pem.decode("ascii"))).digest()


def load_or_create_identity(config: Path) -> TlsIdentity:
    """The worker's certificate from `<config>/tls/`, made on first use."""
    d = config / "tls"
    key_path, cert_path = d / "worker-key.pem", d / "worker-cert.pem"
    if key_path.is_file() and cert_path.is_file():
        return _read_identity(key_path, cert_path)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    with locked(d / ".lock"):  # workers that share this folder and start at once make one pair
        if key_path.is_file() and cert_path.is_file():
            return _read_identity(key_path, cert_path)
        return _create_identity(key_path, cert_path)


def _read_identity(key_path: Path, cert_path: Path) -> TlsIdentity:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    d = key_path.parent
    key_pem, cert_pem = key_path.read_bytes(), cert_path.read_bytes()
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TlsError(
            f"cannot read the TLS key or certificate in {d} ({exc}); delete both files and a "
            "new pair is made"
        ) from None
    if cert.public_key().public_numbers() != key.public_key().public_numbers():  # type: ignore[union-attr]
        raise TlsError(
            f"{cert_path} does not belong to {key_path}; delete both and a new pair is made"
        )
    return TlsIdentity(key_pem, cert_pem, _der_sha256(cert_pem))


def _create_identity(key_path: Path, cert_path: Path) -> TlsIdentity:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = key_path.parent
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))  # tolerate a slow clock elsewhere
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path, data, mode in ((key_path, key_pem, 0o600), (cert_path, cert_pem, 0o644)):
        tmp = private_tmp(path)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(data)
        tmp.replace(path)
    return TlsIdentity(key_pem, cert_pem, _der_sha256(cert_pem))


def server_ssl_context(identity: TlsIdentity) -> ssl.SSLContext:
    """TLS for a node's data port (transport/dataplane.py), with the worker's own certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as d:  # the ssl module loads a key only from a file
        key, cert = Path(d) / "key.pem", Path(d) / "cert.pem"
        with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(identity.key_pem)
        cert.write_bytes(identity.cert_pem)
        ctx.load_cert_chain(cert, key)
    return ctx


def client_ssl_context() -> ssl.SSLContext:
    """TLS to a node (its data port; gRPC's first look in `fetch_certificate`): no CA and no name
    check here; the caller compares the certificate's sha256 with the one the pool handshake
    pinned (both proofs cover it)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def server_credentials(identity: TlsIdentity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(identity.key_pem, identity.cert_pem)])


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def fetch_certificate(address: str, timeout: float = 5.0) -> tuple[bytes, bytes]:
    """The certificate (PEM) the node at `address` presents, and its sha256. Not verified here:
    the pool handshake checks it (both proofs cover its sha256)."""
    host, port = split_address(address)
    ctx = client_ssl_context()  # no CA: the HMAC handshake pins the certificate
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
    except ssl.SSLError as exc:
        raise TlsError(
            f"node {address} did not answer in TLS ({exc.reason or exc}); start its worker with "
            "--tls, or run this head without --tls"
        ) from None
    except OSError as exc:
        raise TlsError(
            f"node {address} is unreachable ({exc}); is `potluck worker` running there and the "
            "port open?"
        ) from None
    if not der:
        raise TlsError(f"node {address} presented no TLS certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii"), hashlib.sha256(der).digest()


def speaks_tls(address: str, timeout: float = 2.0) -> bool:
    """Whether the node completes a TLS handshake (to explain why a plain channel failed)."""
    try:
        fetch_certificate(address, timeout)
    except TlsError:
        return False
    return True


def channel_credentials(cert_pem: bytes) -> grpc.ChannelCredentials:
    """Trust exactly this certificate (the node's own, fetched just before)."""
    return grpc.ssl_channel_credentials(root_certificates=cert_pem)


CHANNEL_TLS_OPTIONS = [("grpc.ssl_target_name_override", SERVER_NAME)]
