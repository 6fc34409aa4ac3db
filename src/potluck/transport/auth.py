"""Who may use a node: the pool secret's mutual challenge-response and the sessions it opens.

The handshake (two unary calls of the NodeAuth service, before any other call):

    client                                              node
    Challenge(version, cn = 32 random bytes)  ──────►   ch = sn ‖ t ‖ MAC(node's own random key,
                                              ◄──────        sn ‖ t ‖ cn ‖ connection)
    Prove(cn, ch, fp_seen,
          HMAC(K, "client", cn, ch, fp_seen)) ──────►   checks ch (its own, < 30 s old, from this
                                                         connection, never used) and the proof
                                              ◄──────   session, HMAC(K, "server", cn, ch, fp, session)
    checks the node's proof, then sends `potluck-session: <session>` with every call

K is derived from the pool secret, which never crosses the wire. `fp` is the sha256 of the node's
TLS certificate ("" without TLS), so with `--tls` the proofs also pin the certificate: a machine in
between that shows its own certificate cannot finish the handshake (transport/tls.py).

Why it resists replay: the node keeps no state for a challenge it hands out (the MAC makes it
self-checking), so strangers cannot fill its memory; a challenge is accepted once (the node
remembers used ones until they expire, at most MAX_USED_CHALLENGES, and only after a valid proof),
and the node's proof covers the client's fresh nonce. A session is bound to the connection
(peer address and port) that proved, ends after SESSION_IDLE_S unused or SESSION_MAX_S in all, and
a node holds at most MAX_SESSIONS (the least recently used goes; its client simply proves again).

Without `--tls` the handshake keeps the secret safe and keeps strangers out, but traffic is neither
encrypted nor protected against a machine in between that rewrites it: use `--tls` where the
network itself is not trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from potluck.errors import NodeError
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.codec import PROTOCOL_VERSION
from potluck.transport.tls import TlsIdentity

SESSION_METADATA = "potluck-session"
SESSION_PREFIX = "session: "  # a refusal the client cures by proving again
NONCE_BYTES = 32
CHALLENGE_TTL_S = 30.0
SESSION_IDLE_S = 3600.0
SESSION_MAX_S = 12 * 3600.0
MAX_SESSIONS = 256
MAX_USED_CHALLENGES = 4096
# Calls a stranger may make: what a node is (Hello, as mDNS already tells the network) and the
# handshake itself. Everything else, including methods added later, needs a session.
OPEN_METHODS = frozenset(
    {
        "/potluck.v1.Node/Hello",
        "/potluck.v1.NodeAuth/Challenge",
        "/potluck.v1.NodeAuth/Prove",
    }
)
MISMATCH_HINT = "set the same --secret / POTLUCK_SECRET on every machine"
_KEY_LABEL = b"potluck pool key v1"
_SN_BYTES, _TIME_BYTES, _MAC_BYTES = 16, 8, 32
CHALLENGE_BYTES = _SN_BYTES + _TIME_BYTES + _MAC_BYTES


class AuthError(NodeError):
    """A node and this machine do not hold the same pool secret, or a handshake failed."""


@dataclass(frozen=True)
class PoolAuth:
    """How this machine proves pool membership: the key derived from the pool secret (None: no
    secret, only for loopback), whether channels use TLS, and (on a worker with TLS) its own
    certificate. Built once by the CLI (cli/peers.py) and passed down."""

    key: bytes | None = field(default=None, repr=False)
    tls: bool = False
    identity: TlsIdentity | None = None

    def __post_init__(self) -> None:
        if self.tls and self.key is None:
            raise AuthError(
                "--tls needs a pool secret: the secret is what pins each worker's certificate; "
                "make one with `potluck secret --save`"
            )

    @classmethod
    def from_secret(
        cls, secret: str | None, tls: bool = False, identity: TlsIdentity | None = None
    ) -> PoolAuth:
        return cls(derive_key(secret) if secret else None, tls, identity)

    @property
    def cert_sha256(self) -> bytes:
        return self.identity.sha256 if self.identity is not None else b""


def derive_key(secret: str) -> bytes:
    """The HMAC key: the secret itself is never used on the wire, not even hashed alone."""
    return hmac.new(secret.encode("utf-8"), _KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over a label and length-prefixed parts (no two inputs share an encoding)."""
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def client_proof(key: bytes, cn: bytes, challenge: bytes, cert_sha256: bytes) -> bytes:
    return _mac(key, b"potluck-v1 client", cn, challenge, cert_sha256)


def server_proof(
    key: bytes, cn: bytes, challenge: bytes, cert_sha256: bytes, session: str
) -> bytes:
    return _mac(key, b"potluck-v1 server", cn, challenge, cert_sha256, session.encode())


def data_client_proof(key: bytes, sn: bytes, cn: bytes, cert_sha256: bytes) -> bytes:
    """The client's proof on a data connection (transport/dataplane.py): both fresh nonces and
    the node's TLS certificate (b"" without TLS)."""
    return _mac(key, b"potluck-v1 data client", sn, cn, cert_sha256)


def data_server_proof(key: bytes, sn: bytes, cn: bytes, cert_sha256: bytes) -> bytes:
    return _mac(key, b"potluck-v1 data server", sn, cn, cert_sha256)


# -- the node's side ------------------------------------------------------------------------------


@dataclass
class _Session:
    peer: str
    created: float
    used: float


class SessionTable:
    """Open sessions by token; bounded, expiring, each bound to one connection (its peer)."""

    def __init__(
        self,
        max_sessions: int = MAX_SESSIONS,
        idle_s: float = SESSION_IDLE_S,
        max_s: float = SESSION_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions, self.idle_s, self.max_s, self.clock = max_sessions, idle_s, max_s, clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first

    def open(self, peer: str) -> str:
        token = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._sessions[token] = _Session(peer, now, now)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return token

    def check(self, token: str, peer: str | None = None) -> str | None:
        """None if the session is open (and, with `peer`, bound to that connection); else why not."""
        now = self.clock()
        with self._lock:
            s = self._sessions.get(token)
            if s is None:
                return "unknown or ended session"
            if now - s.used > self.idle_s or now - s.created > self.max_s:
                del self._sessions[token]
                return "expired session"
            if peer is not None and peer != s.peer:
                return "session of another connection"
            s.used = now
            self._sessions.move_to_end(token)
            return None

    def __len__(self) -> int:
        return len(self._sessions)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Handshakes:
    """The node's half of the handshake. Challenges are stateless (MAC'd with a key only this
    process knows); used ones are remembered until they expire, and only after a valid proof."""

    def __init__(
        self, auth: PoolAuth, sessions: SessionTable, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.auth, self.sessions, self.clock = auth, sessions, clock
        self._own = os.urandom(32)  # signs this process's challenges; never leaves it
        self._lock = threading.Lock()
        self._used: OrderedDict[bytes, float] = OrderedDict()  # challenge -> expiry

    def challenge(self, cn: bytes, peer: str) -> bytes:
        sn = os.urandom(_SN_BYTES)
        t = int(self.clock() * 1000).to_bytes(_TIME_BYTES, "big")
        return sn + t + _mac(self._own, b"challenge", sn, t, cn, peer.encode())

    def prove(self, req: pb.ProveRequest, peer: str) -> pb.ProveReply:
        key = self.auth.key
        if key is None:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, "this node has no pool secret; no proof needed"
            )
        ch, cn = bytes(req.challenge), bytes(req.client_nonce)
        if len(ch) != CHALLENGE_BYTES or len(cn) != NONCE_BYTES or len(req.client_proof) != 32:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed proof")
        sn, t, tag = ch[:_SN_BYTES], ch[_SN_BYTES:-_MAC_BYTES], ch[-_MAC_BYTES:]
        if not hmac.compare_digest(tag, _mac(self._own, b"challenge", sn, t, cn, peer.encode())):
            raise _Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "challenge: not issued by this node to this connection; ask for a new one",
            )
        now = self.clock()
        if now - int.from_bytes(t, "big") / 1000 > CHALLENGE_TTL_S:
            raise _Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"challenge: older than {CHALLENGE_TTL_S:.0f} s; ask for a new one",
            )
        seen, own = bytes(req.seen_cert_sha256), self.auth.cert_sha256
        # the proof must cover the certificate this node holds; what the client says it saw only
        # tells the two failures apart
        if not hmac.compare_digest(bytes(req.client_proof), client_proof(key, cn, ch, own)):
            if seen != own:
                raise _Refused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"TLS certificate mismatch: the head was shown a certificate with sha256 "
                    f"{seen.hex()[:16] or '(none)'}, this node's is "
                    f"{self.auth.cert_sha256.hex()[:16] or '(none: no TLS)'}; something between "
                    "the two machines answered in this node's place",
                )
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, "pool secret mismatch")
        with self._lock:
            while self._used and next(iter(self._used.values())) < now:
                self._used.popitem(last=False)
            if ch in self._used:
                raise _Refused(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "challenge: already used (a replayed handshake); ask for a new one",
                )
            if len(self._used) >= MAX_USED_CHALLENGES:
                raise _Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "too many handshakes at once; retry"
                )
            self._used[ch] = now + CHALLENGE_TTL_S
        session = self.sessions.open(peer)
        return pb.ProveReply(
            server_proof=server_proof(key, cn, ch, self.auth.cert_sha256, session),
            session=session,
            idle_seconds=int(self.sessions.idle_s),
        )


class AuthService(pb_grpc.NodeAuthServicer):
    """The NodeAuth gRPC service (open to anyone, see OPEN_METHODS)."""

    def __init__(self, handshakes: Handshakes) -> None:
        self.handshakes = handshakes

    def Challenge(
        self, request: pb.ChallengeRequest, context: grpc.ServicerContext
    ) -> pb.ChallengeReply:
        if request.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} from the head, this node speaks "
                f"{PROTOCOL_VERSION}; install the same Potluck version on every machine",
            )
        if len(request.client_nonce) != NONCE_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"client nonce of {len(request.client_nonce)} bytes, expected {NONCE_BYTES}",
            )
        if self.handshakes.auth.key is None:
            return pb.ChallengeReply(secret_required=False)
        return pb.ChallengeReply(
            secret_required=True,
            challenge=self.handshakes.challenge(bytes(request.client_nonce), context.peer()),
        )

    def Prove(self, request: pb.ProveRequest, context: grpc.ServicerContext) -> pb.ProveReply:
        try:
            return self.handshakes.prove(request, context.peer())
        except _Refused as exc:
            context.abort(exc.code, exc.message)


# -- the client's side ----------------------------------------------------------------------------


def handshake(
    stub: pb_grpc.NodeAuthStub,
    auth: PoolAuth,
    address: str,
    seen_cert_sha256: bytes,
    timeout: float,
) -> str | None:
    """Prove membership to the node at `address` and check its proof: the session token, or None
    when neither side has a secret. Raises AuthError with what to do."""
    cn = os.urandom(NONCE_BYTES)
    reply: pb.ChallengeReply = stub.Challenge(
        pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=cn), timeout=timeout
    )
    key = auth.key
    if not reply.secret_required:
        if key is not None:
            raise AuthError(
                f"node {address} has no pool secret, so it cannot prove it belongs to this pool: "
                f"start its worker with the same secret ({MISMATCH_HINT})"
            )
        return None
    if key is None:
        raise AuthError(
            f"node {address} rejected this head: pool secret mismatch (this head has none; "
            f"{MISMATCH_HINT})"
        )
    ch = bytes(reply.challenge)
    proved: pb.ProveReply = stub.Prove(
        pb.ProveRequest(
            client_nonce=cn,
            challenge=ch,
            seen_cert_sha256=seen_cert_sha256,
            client_proof=client_proof(key, cn, ch, seen_cert_sha256),
        ),
        timeout=timeout,
    )
    want = server_proof(key, cn, ch, seen_cert_sha256, proved.session)
    if not hmac.compare_digest(bytes(proved.server_proof), want):
        raise AuthError(
            f"node {address} did not prove it knows the pool secret: it is not a member of this "
            "pool (a machine of another pool at that address, or something in between)"
        )
    return proved.session


def explain_refusal(address: str, code: grpc.StatusCode, detail: str) -> AuthError | None:
    """A node's refusal of a handshake or of a call without a valid session, as one line."""
    if code == grpc.StatusCode.PERMISSION_DENIED and detail == "pool secret mismatch":
        return AuthError(
            f"node {address} rejected this head: pool secret mismatch ({MISMATCH_HINT})"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED and detail.startswith("TLS certificate mismatch"):
        return AuthError(f"node {address} rejected this head: {detail}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"node {address} rejected this head: {detail} ({MISMATCH_HINT})")
    return None
