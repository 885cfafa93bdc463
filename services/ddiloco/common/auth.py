"""Who is calling, and may they: the authorization of every call a service serves.

gRPC's mutual TLS already refused any peer without a certificate of the run CA before a
handler runs (the client sees UNAVAILABLE: no connection). What is left to decide per call,
from the caller's certificate (``ddiloco.common.certs.Identity``):

* a certificate on the deny list (revoked): ``Unauthenticated`` (its credentials are no
  longer valid);
* a certificate of the CA whose identity names no known role, a role the method's policy
  does not admit, or a learner acting as another learner id: ``PermissionDenied``.

Each service states one ``Policy`` (method -> admitted roles); a method missing from it is
refused to everyone (fail closed). Both are typed refusals of ``ddiloco.common.errors``:
nothing here knows gRPC status codes, the servicers' edge maps them
(``ddiloco.common.rpc.refusals_as_status``).
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
from typing import Callable, Mapping

from ddiloco.common.certs import CertError, Identity, parse_deny_list
from ddiloco.common.errors import PermissionDenied, Unauthenticated
from ddiloco.common.security import Security

log = logging.getLogger(__name__)

# role groups of the policies
ANY = frozenset({"coordinator", "outer", "learner", "operator"})
LEARNER = frozenset({"learner"})
OUTER = frozenset({"outer"})
COORDINATOR = frozenset({"coordinator"})

Policy = Mapping[str, frozenset]

DENY_RELOAD_S = 1.0  # how stale the deny list may be: far below any lease


class DenyList:
    """Revoked serial numbers from a file, re-read when it changes (checked at most every
    ``DENY_RELOAD_S``), so ``ddiloco certs revoke`` takes effect while the service runs.

    What is read replaces the list in force only when it is a whole, well-formed list:
    revocation fails closed, a file caught in a bad state must not let anyone back in.

    * A file that cannot be opened or read (missing, renamed away, unreadable), or that is
      malformed (a line that is no serial, a last line cut off before its newline:
      ``certs.read_deny_list``), keeps the list in force. It is logged once per episode (at
      the first failure, and again only after the file has been read well in between).
    * An empty file (0 bytes) keeps the list in force: it is what a writer that truncates
      the file before writing it leaves for a moment. To lift every revocation, write a
      file that holds no serial but a comment line (what ``ddiloco certs init`` writes).
    * A list that lifts revocations (holds fewer of the serials in force) takes effect only
      once the file has stayed unchanged for ``DENY_RELOAD_S``: a rewrite in progress can
      show a prefix of the new file that ends at a line; new revocations take effect at once.
    """

    def __init__(self, path: pathlib.Path | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._serials: frozenset[int] = frozenset()
        self._stamp: tuple[int, int, int] | None = None  # of the file the list in force was read from
        self._lifting: tuple[tuple[int, int, int], frozenset[int], float] | None = None  # (stamp, serials, seen at)
        self._trouble = False  # an episode of unreadable or malformed files is logged once
        self._checked = -float("inf")
        self._lock = threading.Lock()
        self.reload()

    def reload(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())  # of the file read, even if the name moves meanwhile
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
                if stamp == self._stamp or (self._lifting is not None and stamp == self._lifting[0]):
                    data = None  # read already
                else:
                    data = f.read()
        except OSError as exc:
            self._troubled(f"cannot read it ({exc.strerror or exc})")
            return
        if data is None:
            if self._lifting is not None and stamp == self._lifting[0] and self.clock() - self._lifting[2] >= DENY_RELOAD_S:
                self._apply(self._lifting[1], stamp)
            return
        try:
            serials = parse_deny_list(data, str(self.path))
        except CertError as exc:
            self._troubled(str(exc))
            return
        if not data and self._serials:
            self._troubled("it is empty (0 bytes; to lift every revocation, write a comment line)")
            return
        if self._trouble:
            log.info("deny list %s read again", self.path)
            self._trouble = False
        if self._serials <= serials:
            self._apply(serials, stamp)
        else:
            self._lifting = (stamp, serials, self.clock())
            log.info("deny list %s lifts %d revocation(s) once it stays unchanged for %.0f s",
                     self.path, len(self._serials - serials), DENY_RELOAD_S)

    def _apply(self, serials: frozenset[int], stamp: tuple[int, int, int]) -> None:
        if serials != self._serials:
            log.info("deny list %s: %d revoked certificate(s)", self.path, len(serials))
        self._serials, self._stamp, self._lifting = serials, stamp, None

    def _troubled(self, why: str) -> None:
        if not self._trouble:
            self._trouble = True
            log.error("deny list %s: %s; the %d revocation(s) in force stay in force", self.path, why, len(self._serials))

    def __contains__(self, serial: int) -> bool:
        with self._lock:
            now = self.clock()
            if now - self._checked >= DENY_RELOAD_S:
                self._checked = now
                self.reload()
            return serial in self._serials


class Authorizer:
    """Checks calls against one service's ``Policy``. With insecure ``Security`` every call
    is admitted and no identity is known (``None``): the explicit opt-out."""

    def __init__(self, security: Security, policy: Policy, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = security.enabled
        self.policy = policy
        self.deny = DenyList(security.revoked, clock) if security.enabled else None
        self._identities: dict[bytes, Identity | CertError] = {}  # parsed once per certificate
        self._lock = threading.Lock()

    def identity(self, auth_context: Mapping[str, list[bytes]]) -> Identity | None:
        """The caller's identity from gRPC's auth context, or None without TLS."""
        if not self.enabled:
            return None
        pems = auth_context.get("x509_pem_cert") or []
        if len(pems) != 1:
            raise Unauthenticated("the call carries no client certificate")
        ident = self._parse(pems[0])
        if isinstance(ident, CertError):
            # signed by the run CA (TLS checked that), but no role this run knows: not allowed
            raise PermissionDenied(f"the client certificate names no ddiloco identity: {ident}")
        assert self.deny is not None
        if ident.serial in self.deny:
            raise Unauthenticated(f"the certificate of {ident.describe()} (serial {ident.serial:x}) is revoked")
        return ident

    def _parse(self, pem: bytes) -> Identity | CertError:
        with self._lock:
            found = self._identities.get(pem)
        if found is not None:
            return found
        from cryptography import x509

        from ddiloco.common.certs import identity_of

        try:
            found = identity_of(x509.load_pem_x509_certificate(pem))
        except CertError as exc:
            found = exc
        except ValueError as exc:
            found = CertError(str(exc))
        with self._lock:
            if len(self._identities) > 4096:  # bounded: certificates are few, attackers are not
                self._identities.clear()
            self._identities[pem] = found
        return found

    def check(self, auth_context: Mapping[str, list[bytes]], method: str, learner_id: int | None = None) -> Identity | None:
        """Admit a call of ``method``, or raise. ``learner_id``: the learner the request acts
        for, which a learner's certificate must name."""
        ident = self.identity(auth_context)
        if ident is None:
            return None
        roles = self.policy.get(method, frozenset())
        if ident.role not in roles:
            allowed = ", ".join(sorted(roles)) or "nobody"
            raise PermissionDenied(f"{ident.describe()} may not call {method} (allowed: {allowed})")
        if learner_id is not None and ident.role == "learner" and ident.learner_id != learner_id:
            raise PermissionDenied(f"{ident.describe()} acts only as learner {ident.learner_id}, not as learner {learner_id}")
        return ident
