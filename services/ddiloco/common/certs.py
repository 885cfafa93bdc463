"""A run's certificate authority and the certificates of its services (``ddiloco certs``).

Layout of a certificate folder (``DIR``)::

    DIR/ca.crt, DIR/ca.key          the run CA (the key never leaves DIR)
    DIR/revoked.txt                 serial numbers shut out (``revoke``), one per line
    DIR/<name>/ca.crt, tls.crt, tls.key
                                    one identity: what a service's --tls-dir points to
    DIR/learners.json               every learner identity in one file (``setup``), for
                                    replicated learners whose slot picks theirs at start
                                    (``unbundle``; Compose, Swarm and Kubernetes secrets)

An identity folder holds exactly what one process needs (the CA to trust, its own
certificate and key), so it can be mounted alone as a secret. Keys are written with mode
0600 and never printed.

What a certificate says about its holder (``Identity``):

* subject CN: the name (``coordinator``, ``outer``, ``learner-3``, ``operator``);
* subject OU: the role, one of ``ROLES``; the servers authorise every call by it;
* a learner's id as the URI SAN ``urn:ddiloco:learner:<id>``: a learner acts only as
  this id, whatever its requests say;
* DNS SAN ``<role>.ddiloco``: the name a client checks when it dials a service of that
  role, so a learner's certificate can never pass for the coordinator's; plus the name,
  ``localhost``, 127.0.0.1 and any ``--host`` given (health checks dial addresses).

Both key usages (server and client) are in every certificate: each service serves and
dials.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("coordinator", "outer", "learner", "operator")
LEARNER_URI = "urn:ddiloco:learner:"
ROLE_DOMAIN = "ddiloco"  # a service of role R presents the DNS name R.ddiloco
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
DEFAULT_DAYS = 365
CA_DAYS = 3650


class CertError(Exception):
    """A certificate folder, name or certificate that cannot be used; says which and why."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate speaks for."""

    name: str
    role: str
    learner_id: int | None  # learners only
    serial: int

    def describe(self) -> str:
        who = f"{self.role} {self.name!r}"
        return f"{who} (learner {self.learner_id})" if self.learner_id is not None else who


def role_host(role: str) -> str:
    """The DNS name a client expects in the certificate of a server of ``role``."""
    return f"{role}.{ROLE_DOMAIN}"


# ------------------------------------------------------------------ parsing
def identity_of(cert: x509.Certificate) -> Identity:
    """Read the identity of a certificate this module issued; ``CertError`` if it lacks a
    name, a known role, or (for a learner) exactly one learner id."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(names) != 1 or len(roles) != 1:
        raise CertError("the certificate needs exactly one CN (name) and one OU (role)")
    name, role = str(names[0].value), str(roles[0].value)
    if role not in ROLES:
        raise CertError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(LEARNER_URI)]
    except x509.ExtensionNotFound:
        uris = []
    learner_id = None
    if role == "learner":
        if len(uris) != 1 or not uris[0][len(LEARNER_URI):].isdigit():
            raise CertError(f"a learner certificate needs exactly one {LEARNER_URI}<id> name")
        learner_id = int(uris[0][len(LEARNER_URI):])
    elif uris:
        raise CertError(f"a {role} certificate must not carry a learner id")
    return Identity(name=name, role=role, learner_id=learner_id, serial=cert.serial_number)


def load_cert(path: pathlib.Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise CertError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CertError(f"{path}: not a PEM certificate ({exc})") from None


# ------------------------------------------------------------------ writing
def _write_private(path: pathlib.Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only, from the first byte (no window in which
    another user could open it)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_public(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def init_ca(folder: pathlib.Path, name: str = "ddiloco run CA", days: int = CA_DAYS) -> pathlib.Path:
    """Create a CA in ``folder`` (made if missing). Refuses a folder that has one: issued
    certificates would silently stop being trusted."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "ca.key").exists() or (folder / "ca.crt").exists():
        raise CertError(f"{folder} already holds a CA (ca.crt/ca.key); use another folder")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(folder / "ca.key", _key_pem(key))
    _write_public(folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    _deny_list_header(folder / "revoked.txt")
    return folder / "ca.crt"


def _deny_list_header(path: pathlib.Path) -> None:
    """An empty deny list starts with a comment: never 0 bytes (a Swarm secret cannot be)."""
    if not path.exists() or path.stat().st_size == 0:
        path.write_text("# revoked certificate serial numbers (hex), one per line: `ddiloco certs revoke`\n")


def learner_id_from_name(name: str) -> int | None:
    m = re.fullmatch(r"learner-(\d+)", name)
    return int(m.group(1)) if m else None


def issue(
    folder: pathlib.Path,
    name: str,
    role: str,
    learner_id: int | None = None,
    hosts: tuple[str, ...] = (),
    days: int = DEFAULT_DAYS,
    valid_from: datetime.datetime | None = None,
) -> pathlib.Path:
    """Issue a key and certificate for ``name`` signed by the CA in ``folder``; returns the
    identity folder ``folder/name``. A learner's id is ``learner_id``, else the number of a
    name ``learner-<id>``. Issuing a name again replaces its key (rotation): revoke the old
    certificate's serial if its key may have leaked."""
    if role not in ROLES:
        raise CertError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    if not NAME_RE.match(name):
        raise CertError(f"name {name!r}: use 1 to 63 lower-case letters, digits and '-' (it is a folder and a DNS name)")
    if role == "learner":
        learner_id = learner_id if learner_id is not None else learner_id_from_name(name)
        if learner_id is None or learner_id < 0:
            raise CertError(f"a learner certificate needs a learner id: --learner-id, or a name learner-<id> (got {name!r})")
    elif learner_id is not None:
        raise CertError(f"only learner certificates carry a learner id (role {role!r})")
    ca_key_path, ca_cert_path = folder / "ca.key", folder / "ca.crt"
    if not ca_key_path.exists() or not ca_cert_path.exists():
        raise CertError(f"{folder} holds no CA: run `ddiloco certs init {folder}` first")
    try:
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise CertError(f"{ca_key_path}: cannot load the CA key ({exc})") from None
    ca_cert = load_cert(ca_cert_path)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = [x509.DNSName(role_host(role)), x509.DNSName(name), x509.DNSName("localhost"),
                                   x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    if learner_id is not None:
        alt.append(x509.UniformResourceIdentifier(f"{LEARNER_URI}{learner_id}"))
    start = valid_from or (_now() - datetime.timedelta(minutes=5))  # tolerate small clock skew
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                 x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)  # type: ignore[arg-type]
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    out = folder / name
    out.mkdir(exist_ok=True)
    _write_private(out / "tls.key", _key_pem(key))
    _write_public(out / "tls.crt", cert.public_bytes(serialization.Encoding.PEM))
    _write_public(out / "ca.crt", ca_cert_path.read_bytes())
    return out


def revoke(folder: pathlib.Path, name: str | None = None, serial: int | None = None) -> int:
    """Add a certificate's serial number to ``folder/revoked.txt`` (the deny list the
    coordinator and outer optimizer reload); by ``name`` (its current certificate) or by
    ``serial``. Returns the serial."""
    if (name is None) == (serial is None):
        raise CertError("revoke one certificate: give a name or a serial number")
    if name is not None:
        serial = load_cert(folder / name / "tls.crt").serial_number
    assert serial is not None
    deny = folder / "revoked.txt"
    listed = read_deny_list(deny) if deny.exists() else frozenset()
    if serial not in listed:
        with open(deny, "a") as f:
            f.write(f"{serial:x}\n")
    return serial


def read_deny_list(path: pathlib.Path) -> frozenset[int]:
    """Serial numbers in hex, one per line; '#' starts a comment. A malformed line is an
    error, never skipped: a typo must not silently let a revoked certificate back in."""
    serials = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip().lower().removeprefix("0x")
        if not text:
            continue
        try:
            serials.add(int(text, 16))
        except ValueError:
            raise CertError(f"{path}:{n}: not a hexadecimal serial number: {line.strip()!r}") from None
    return frozenset(serials)


def setup_run(folder: pathlib.Path, learners: int, hosts: tuple[str, ...] = ()) -> list[str]:
    """A CA and the certificates of one run's services in ``folder``: the coordinator, the
    outer optimizer, an ``operator`` (the launcher's and health checks' read-only client),
    and a learner certificate for every id a run of ``learners`` (M) admits, ``learner-0``
    .. ``learner-<2M-1>`` (the coordinator's id range: the planned learners and one extra
    per shard, e.g. Compose's ``--scale``). What already exists is kept, so this is safe to
    repeat (a resumed run, a restarted Compose ``certs`` service); returns the names it
    issued now."""
    if not (folder / "ca.crt").exists():
        init_ca(folder)
    _deny_list_header(folder / "revoked.txt")
    wanted = [("coordinator", "coordinator"), ("outer", "outer"), ("operator", "operator")]
    wanted += [(f"learner-{i}", "learner") for i in range(2 * learners)]
    issued = []
    for name, role in wanted:
        if not (folder / name / "tls.crt").exists() or not (folder / name / "tls.key").exists():
            issue(folder, name, role, hosts=hosts)
            issued.append(name)
    write_bundle(folder, [f"learner-{i}" for i in range(2 * learners)], folder / "learners.json")
    return issued


def write_bundle(folder: pathlib.Path, names: list[str], out: pathlib.Path) -> pathlib.Path:
    """Identities ``names`` of ``folder`` in one JSON file (mode 0600): the run CA and each
    name's certificate and key. JSON, never a pickle or an archive: reading it runs nothing."""
    import json

    doc = {"ca": (folder / "ca.crt").read_text(), "identities": {
        name: {"cert": (folder / name / "tls.crt").read_text(), "key": (folder / name / "tls.key").read_text()} for name in names
    }}
    _write_private(out, json.dumps(doc, sort_keys=True).encode())
    return out


def unbundle(bundle: pathlib.Path, name: str, into: pathlib.Path) -> pathlib.Path:
    """Write identity ``name`` of a bundle as an identity folder ``into`` (ca.crt, tls.crt,
    tls.key, the key 0600)."""
    import json

    try:
        doc = json.loads(bundle.read_text())
        entry = doc["identities"][name]
        ca, cert, key = doc["ca"], entry["cert"], entry["key"]
    except OSError as exc:
        raise CertError(f"{bundle}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError):
        raise CertError(f"{bundle}: holds no identity {name!r} (a bundle of `ddiloco certs setup`?)") from None
    into.mkdir(parents=True, exist_ok=True)
    os.chmod(into, 0o700)
    _write_private(into / "tls.key", key.encode())
    _write_public(into / "tls.crt", cert.encode())
    _write_public(into / "ca.crt", ca.encode())
    return into
