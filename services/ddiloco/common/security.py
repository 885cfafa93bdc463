"""How one process authenticates itself and its peers: the typed ``Security`` object.

Every service gets one, built and validated here from ``--tls-dir`` / ``--insecure``
(``security_from_args``), and passes it down explicitly; ``ddiloco.common.rpc`` turns it
into server and channel credentials. Secure is the default: a service given neither flag
refuses to start, so a deployment can never fall back to plaintext by omission.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
from dataclasses import dataclass, field

from ddiloco.common.certs import CertError, Identity

# what a service's --tls-dir must hold (``ddiloco certs issue`` writes exactly these)
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"


@dataclass(frozen=True)
class Security:
    """Mutual TLS from one identity folder, or explicitly none (``insecure()``)."""

    tls_dir: pathlib.Path | None = None
    # the deny list this process reloads (coordinator and outer optimizer); None: none
    revoked: pathlib.Path | None = None
    identity: Identity | None = None
    ca_pem: bytes = field(default=b"", repr=False)
    cert_pem: bytes = field(default=b"", repr=False)
    key_pem: bytes = field(default=b"", repr=False)  # never in a repr, a log line or an error

    @property
    def enabled(self) -> bool:
        return self.tls_dir is not None

    @classmethod
    def insecure(cls) -> "Security":
        return cls()

    @classmethod
    def from_dir(cls, tls_dir: pathlib.Path, role: str | None = None, revoked: pathlib.Path | None = None) -> "Security":
        """Load and check an identity folder: the three files present, the key matching the
        certificate, the certificate signed by the CA, valid now, and of ``role`` if given.
        Raises ``CertError`` saying what is wrong (never showing the key)."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization

        from ddiloco.common.certs import identity_of

        tls_dir = pathlib.Path(tls_dir)
        data = {}
        for fname in (CA_FILE, CERT_FILE, KEY_FILE):
            try:
                data[fname] = (tls_dir / fname).read_bytes()
            except OSError as exc:
                raise CertError(f"--tls-dir {tls_dir}: cannot read {fname}: {exc.strerror or exc}") from None
        try:
            ca = x509.load_pem_x509_certificate(data[CA_FILE])
            cert = x509.load_pem_x509_certificate(data[CERT_FILE])
        except ValueError as exc:
            raise CertError(f"--tls-dir {tls_dir}: not a PEM certificate ({exc})") from None
        try:
            key = serialization.load_pem_private_key(data[KEY_FILE], password=None)
        except (ValueError, TypeError):
            raise CertError(f"--tls-dir {tls_dir}: {KEY_FILE} is not an unencrypted PEM private key") from None
        if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
            raise CertError(f"--tls-dir {tls_dir}: {KEY_FILE} is not the key of {CERT_FILE}")
        try:
            cert.verify_directly_issued_by(ca)
        except (InvalidSignature, ValueError, TypeError) as exc:
            raise CertError(f"--tls-dir {tls_dir}: {CERT_FILE} is not signed by {CA_FILE} ({type(exc).__name__})") from None
        now = datetime.datetime.now(datetime.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise CertError(
                f"--tls-dir {tls_dir}: {CERT_FILE} is valid from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} "
                f"to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now; issue a new one"
            )
        identity = identity_of(cert)
        if role is not None and identity.role != role:
            raise CertError(f"--tls-dir {tls_dir}: the certificate is a {identity.role}'s, this service is the {role}")
        if revoked is not None and not pathlib.Path(revoked).exists():
            raise CertError(f"--revoked {revoked}: no such file (create it empty: nothing revoked)")
        return cls(tls_dir, revoked, identity, data[CA_FILE], data[CERT_FILE], data[KEY_FILE])


def add_security_arguments(parser: argparse.ArgumentParser, revocation: bool = False) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--tls-dir", type=pathlib.Path, default=None,
                       help="mutual TLS: this service's identity folder (ca.crt, tls.crt, tls.key; `ddiloco certs issue`)")
    group.add_argument("--insecure", action="store_true",
                       help="no TLS and no authorization: anyone who reaches a port is trusted (tests, a private machine)")
    if revocation:
        group.add_argument("--revoked", type=pathlib.Path, default=None,
                           help="deny list of revoked certificate serials, reloaded while serving (`ddiloco certs revoke`)")


def security_from_args(args: argparse.Namespace, role: str | None) -> Security:
    """The ``Security`` of a service from its flags; ``SystemExit`` with one line if they
    are missing, contradictory or point at unusable files."""
    tls_dir, insecure = getattr(args, "tls_dir", None), getattr(args, "insecure", False)
    revoked = getattr(args, "revoked", None)
    if tls_dir is not None and insecure:
        raise SystemExit("give --tls-dir or --insecure, not both")
    if insecure:
        if revoked is not None:
            raise SystemExit("--revoked needs --tls-dir: without TLS there are no certificates to revoke")
        return Security.insecure()
    if tls_dir is None:
        raise SystemExit(
            "no --tls-dir (or DDILOCO_TLS_DIR): services authenticate each other with mutual TLS "
            "(`ddiloco certs --help`); give --insecure to run without it"
        )
    try:
        return Security.from_dir(tls_dir, role, revoked)
    except CertError as exc:
        raise SystemExit(str(exc)) from None
