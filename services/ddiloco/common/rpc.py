"""gRPC plumbing shared by every service: servers with health, reflection, keepalive and
graceful shutdown; client channels; retry with backoff; chunked payload streams.

The one place where sockets get their security: ``Server`` and ``channel`` take the
process's ``Security`` (``ddiloco.common.security``) and serve or dial with mutual TLS when
it is enabled, plaintext only when it was explicitly made insecure."""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
import time
from concurrent import futures
from typing import Callable, Iterable, Iterator, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from ddiloco.common import auth, errors
from ddiloco.common.config_rules import MAX_MESSAGE_BYTES
from ddiloco.common.security import Security
from ddiloco.common.slots import Release, Slots

log = logging.getLogger(__name__)

# The one place where the domain's typed refusals (``common/errors.py``) become gRPC status
# codes, for every service.
STATUS_OF = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Stale: grpc.StatusCode.FAILED_PRECONDITION,  # a final verdict: the learner drops the delta
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.WrongShard: grpc.StatusCode.UNAVAILABLE,  # retried: the caller's map of shards is stale
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.Superseded: grpc.StatusCode.ABORTED,  # a learner reads it as "stop now", not "drain"
}


def status_code(exc: errors.Refused) -> grpc.StatusCode:
    """The status code of a refusal (of its nearest mapped class)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    raise TypeError(f"{type(exc).__name__} has no status code")


@contextlib.contextmanager
def refusals_as_status(context, on_refusal: Callable[[errors.Refused], None] | None = None):
    """Inside a servicer method: a typed refusal raised in the block aborts the call with its
    status code and message (after ``on_refusal``, e.g. a metrics event)."""
    try:
        yield
    except errors.Refused as exc:
        if on_refusal is not None:
            on_refusal(exc)
        context.abort(status_code(exc), exc.message)


def call_ended(context, within_s: float) -> bool:
    """Inside a servicer method: whether the call has ended (its peer cancelled it, or its
    connection is gone) or ends within ``within_s`` seconds. A live peer's call cannot end
    before the servicer answers it, so this waits the whole ``within_s`` for one.

    Why: when a client process dies as it opens a client stream, gRPC may end the request
    iterator as if the client had closed it with no message, and only then report the call
    as cancelled (``is_active()`` is still True at that moment). Measured over a real socket
    by SIGKILLing clients with a stream open: 9 of 16 streams ended that way, and the call's
    end was reported within 0.1 ms of it in every case."""
    ended = threading.Event()
    if not context.add_callback(ended.set):
        return True  # ended already
    return ended.wait(within_s)


# One message at most MAX_MESSAGE_BYTES (common/config_rules.py, which also holds the run's
# membership and statuses to it).

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = KEEPALIVE_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CLIENT_OPTIONS = KEEPALIVE_OPTIONS + [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),  # retries are explicit, see call_with_retry
    # A peer that restarts (same address) must be found again within a couple of seconds;
    # gRPC's default reconnect backoff grows to 120 s, which left a learner's upload waiting
    # ~10 s after a restarted outer optimizer was already serving.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

# Codes that say "not now" about a call, never "not this": the peer is restarting, overloaded
# or out of disk (the outer optimizer answers RESOURCE_EXHAUSTED or UNAVAILABLE for a full
# disk), or the call timed out or was cut. A loop that owns a unit of work (an upload, a
# download) retries these for as long as it takes rather than dropping the work.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
# After these the peer may have received and acted on the call, its answer lost on the way.
AMBIGUOUS = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


# The server's own services, health and reflection, answer every role of the run, and only
# through the same authorization as the services' methods: a revoked certificate is
# UNAUTHENTICATED here too, and a certificate of the CA naming no known role is refused.
CHECK = f"{health.SERVICE_NAME}/Check"
WATCH = f"{health.SERVICE_NAME}/Watch"
REFLECT = f"{reflection.SERVICE_NAME}/ServerReflectionInfo"
INTROSPECTION_POLICY: auth.Policy = {CHECK: auth.ANY, WATCH: auth.ANY, REFLECT: auth.ANY}

# Long-lived streams of health and reflection one caller may hold open at once.
STREAMS_PER_CALLER = 2


def introspection_streams(max_workers: int) -> int:
    """Long-lived health and reflection streams all callers together may hold open: a
    quarter of a server's worker threads (at least 1)."""
    return max(1, max_workers // 4)


def hold_stream(slots: Slots, caller: str) -> Release:
    """A slot in ``slots`` for one more health or reflection stream of ``caller``, or
    ``ResourceExhausted`` over its bound or everyone's; returns the release.

    Why: the server's worker threads are one pool for every call. A reflection stream holds
    one of them from its first message until the client closes it, idle or not (the thread
    waits for its next request), so 16 idle reflection streams of one caller held every
    thread of a coordinator and its learners' Register and Heartbeat queued until their
    leases ran out. Bounding these streams keeps three quarters of the threads for the
    services' own calls, and the bound per caller keeps one caller from taking even the
    quarter from everyone else. (gRPC's ``maximum_concurrent_rpcs`` counts every call alike:
    one caller's idle streams would still fill it, and the services' calls would be refused
    instead of queued, the same outage.) Health Watch holds no thread (it is served
    non-blocking), but it is an open stream all the same and shares the bound."""
    release = slots.claim(caller)
    if release is not None:
        return release
    if slots.full_for(caller):
        raise errors.ResourceExhausted(
            f"{caller} already holds {slots.per_key} health/reflection streams open; close one first")
    raise errors.ResourceExhausted(f"{slots.total} health/reflection streams are open; try again later")


def caller_of(ident: auth.Identity | None, context) -> str:
    """Whom a call's streams are counted against: the certificate's name and role, or
    without TLS (no identity) the peer's address without its port."""
    if ident is not None:
        return f"{ident.role} {ident.name!r}"
    return context.peer().rsplit(":", 1)[0]


class _Introspection:
    """The admission of the calls of health and reflection (see ``INTROSPECTION_POLICY`` and
    ``hold_stream``)."""

    def __init__(self, authorizer: auth.Authorizer, slots: Slots) -> None:
        self.auth = authorizer
        self.slots = slots

    def call(self, context, method: str) -> None:
        with refusals_as_status(context):
            self.auth.check(context.auth_context(), method)

    def stream(self, context, method: str) -> None:
        with refusals_as_status(context):
            ident = self.auth.check(context.auth_context(), method)
            release = hold_stream(self.slots, caller_of(ident, context))
        if not context.add_callback(release):  # ended already
            release()


class _Health(health.HealthServicer):
    def __init__(self, admit: _Introspection) -> None:
        super().__init__(experimental_non_blocking=True)
        self._admit = admit

    def Check(self, request, context):  # noqa: N802 -- the gRPC method's name
        self._admit.call(context, CHECK)
        return super().Check(request, context)

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802
        self._admit.stream(context, WATCH)
        return super().Watch(request, context, send_response_callback)


class _Reflection(reflection.ReflectionServicer):
    def __init__(self, service_names: list[str], admit: _Introspection) -> None:
        super().__init__(service_names)
        self._admit = admit

    def ServerReflectionInfo(self, request_iterator, context):  # noqa: N802
        # not a generator itself: the refusal comes before the first request is waited for
        self._admit.stream(context, REFLECT)
        return super().ServerReflectionInfo(request_iterator, context)


class Server:
    """A gRPC server with grpc.health.v1 and reflection, both authorized like the services'
    own methods (``INTROSPECTION_POLICY``) and their streams bounded (``hold_stream``).

    Health answers NOT_SERVING until ``set_ready()``, and again once shutdown starts, so an
    orchestrator never routes to a process that cannot serve yet or any more.
    """

    def __init__(
        self, bind: str, service_names: Iterable[str], max_workers: int = 16, security: Security | None = None
    ) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS)
        self.security = security or Security.insecure()
        self.streams = Slots(STREAMS_PER_CALLER, introspection_streams(max_workers))
        admit = _Introspection(auth.Authorizer(self.security, INTROSPECTION_POLICY), self.streams)
        self._health = _Health(admit)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.service_names = list(service_names)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            _Reflection(self.service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME], admit), self._server
        )
        self.port = _add_port(self._server, bind, self.security)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {bind}")
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.stopped = threading.Event()

    @property
    def grpc_server(self) -> grpc.Server:
        return self._server

    def _set_all(self, status: int) -> None:
        self._health.set("", status)
        for name in self.service_names:
            self._health.set(name, status)

    def start(self) -> None:
        self._server.start()

    def set_ready(self) -> None:
        self._set_all(health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 5.0) -> None:
        if self.stopped.is_set():
            return
        self._health.enter_graceful_shutdown()  # every service now answers NOT_SERVING
        self._server.stop(grace).wait()
        self.stopped.set()

    def stop_on_signals(self, on_stop: Callable[[], None] | None = None) -> None:
        """SIGTERM/SIGINT: report NOT_SERVING, finish in-flight calls, then exit."""

        def handler(signum, _frame):
            log.info("signal %s: shutting down gracefully", signum)
            if on_stop:
                on_stop()
            threading.Thread(target=self.stop, daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def server_credentials(security: Security) -> grpc.ServerCredentials:
    """Mutual TLS: a client without a certificate signed by the run CA never completes the
    handshake, so no handler runs for it."""
    return grpc.ssl_server_credentials(
        [(security.key_pem, security.cert_pem)], root_certificates=security.ca_pem, require_client_auth=True
    )


class BindError(OSError):
    """A service cannot listen on its ``--bind`` address (in use, not this host's, not an
    address): the commands say so in one line and exit, where gRPC's RuntimeError was a
    traceback."""


def _add_port(server: grpc.Server, bind: str, security: Security) -> int:
    try:
        if security.enabled:
            return server.add_secure_port(bind, server_credentials(security))
        return server.add_insecure_port(bind)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        raise BindError(f"cannot listen on {bind}: in use, or not an address of this host ({exc})") from None


def channel(address: str, security: Security | None = None, server_role: str | None = None) -> grpc.Channel:
    """A client channel. With TLS it presents this process's certificate, trusts only the
    run CA, and, given ``server_role``, accepts only a server certificate issued for that
    role (``<role>.ddiloco``, see ddiloco.common.certs) whatever address was dialed; without
    it the address's host must be a name in the server's certificate. ``security`` None is
    plaintext, which a TLS server refuses at the handshake: forgetting it fails loudly."""
    if security is None or not security.enabled:
        return grpc.insecure_channel(address, options=CLIENT_OPTIONS)
    from ddiloco.common.certs import role_host

    creds = grpc.ssl_channel_credentials(
        root_certificates=security.ca_pem, private_key=security.key_pem, certificate_chain=security.cert_pem
    )
    options = list(CLIENT_OPTIONS)
    if server_role is not None:
        options.append(("grpc.ssl_target_name_override", role_host(server_role)))
    return grpc.secure_channel(address, creds, options=options)


T = TypeVar("T")


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    max_elapsed: float = 60.0,
    initial: float = 0.2,
    maximum: float = 5.0,
    stop: threading.Event | None = None,
    retry_on: frozenset = RETRYABLE,
) -> T:
    """Call ``fn`` until it succeeds, retrying with jittered exponential backoff while the
    peer is unavailable. Other errors, and the last error after ``max_elapsed``, propagate."""
    deadline = time.monotonic() + max_elapsed
    delay = initial
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code not in retry_on or time.monotonic() + delay > deadline:
                raise
            if attempt == 1 or attempt % 10 == 0:
                log.info("%s: %s (%s); retrying", what, code, exc.details() if hasattr(exc, "details") else "")
        sleep = delay * (0.5 + random.random() / 2)
        if stop is not None:
            if stop.wait(sleep):
                raise InterruptedError(f"{what}: stopped while retrying")
        else:
            time.sleep(sleep)
        delay = min(delay * 2, maximum)


class Backoff:
    """Jittered exponential delays for a retry loop that decides for itself what to retry."""

    def __init__(self, initial: float = 0.2, maximum: float = 5.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.delay = initial

    def reset(self) -> None:
        self.delay = self.initial

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay, or less if ``stop`` is set meanwhile; True if it was."""
        sleep = self.delay * (0.5 + random.random() / 2)
        self.delay = min(self.delay * 2, self.maximum)
        return stop.wait(sleep)


def chunks(payload: bytes, chunk_bytes: int) -> Iterator[bytes]:
    if chunk_bytes <= 0:
        raise ValueError("chunk size must be positive")
    view = memoryview(payload)
    for i in range(0, len(payload), chunk_bytes):
        yield bytes(view[i : i + chunk_bytes])
