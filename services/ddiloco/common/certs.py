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

from ddiloco.common.durable import fsync_dir, temporary_name

ROLES = ("coordinator", "outer", "learner", "operator")
LEARNER_URI = "urn:ddiloco:learner:"
ROLE_DOMAIN = "ddiloco"  # a service of role R presents the DNS name R.ddiloco
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
DEFAULT_DAYS = 365
CA_DAYS = 3650
MAX_DAYS = CA_DAYS  # a certificate is of no use past the run CA's own lifetime
# a DNS label (underscores too: Docker's service names have them)
HOST_LABEL_RE = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


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
PRIVATE, PUBLIC = 0o600, 0o644


def _stage(path: pathlib.Path, data: bytes, mode: int) -> pathlib.Path:
    """``data`` in a new temporary file beside ``path``, created with ``mode`` (so a key is
    readable by its owner only from the first byte) and fsynced; returns its name."""
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CertError(f"cannot write {path}: {exc.strerror or exc}; nothing was replaced") from None
    return tmp


def _write_files(files: list[tuple[pathlib.Path, bytes, int]]) -> None:
    """Replace ``files`` (path, content, mode), all of them or none.

    Each is written whole to a temporary first; only once every one is on disk are they
    renamed over the old ones, in the order given (a private key before its certificate).
    Why: writing in place (deleting the old key, then writing the new one) lost the only key
    of an identity when the write failed (a full disk), and a key replaced without its
    certificate leaves a pair that does not load. The failures that happen in practice
    happen while writing, before anything is replaced; a rename needs no space."""
    staged: list[tuple[pathlib.Path, pathlib.Path]] = []
    try:
        for path, data, mode in files:
            staged.append((_stage(path, data, mode), path))
        for tmp, path in staged:
            os.replace(tmp, path)
        for folder in {path.parent for _, path in staged}:
            fsync_dir(folder)
    except OSError as exc:
        raise CertError(f"cannot write {', '.join(str(p) for _, p in staged)}: {exc.strerror or exc}") from None
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)  # gone once renamed; a failed write's own is removed by _stage


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
    _write_files([(folder / "ca.key", _key_pem(key), PRIVATE), (folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), PUBLIC)])
    _deny_list_header(folder / "revoked.txt")
    return folder / "ca.crt"


def _deny_list_header(path: pathlib.Path) -> None:
    """An empty deny list starts with a comment: never 0 bytes (a Swarm secret cannot be)."""
    if not path.exists() or path.stat().st_size == 0:
        path.write_text("# revoked certificate serial numbers (hex), one per line: `ddiloco certs revoke`\n")


def certified_host(host: str) -> x509.GeneralName:
    """What ``--host`` certifies: an IP address, or a DNS name, an internationalized one as
    its ASCII (IDNA) form (``bücher.example`` -> ``xn--bcher-kva.example``, the name DNS
    and TLS compare); ``CertError`` saying why for anything else."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        name = host.encode("idna").decode("ascii").lower()
        # Python's codec is IDNA 2003, which maps a few characters (ß, ς) where IDNA 2008,
        # what DNS uses now, keeps them: a name it cannot give back as written is ambiguous
        if not host.isascii() and name.encode("ascii").decode("idna") != host.lower():
            raise CertError(f"--host {host!r}: its ASCII form is ambiguous ({name!r} in IDNA 2003, another in "
                            "IDNA 2008): give the xn-- form")
    except UnicodeError:
        name = ""
    name = name.removesuffix(".")  # a certificate names hosts without DNS's root dot
    if not name or len(name) > 253 or not all(HOST_LABEL_RE.match(label) for label in name.split(".")):
        raise CertError(f"--host {host!r}: not an IP address or a DNS name (labels of 1 to 63 letters, digits, "
                        "'-' and '_', not starting or ending with '-', at most 253 characters in all)")
    return x509.DNSName(name)


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
    if not 1 <= days <= MAX_DAYS:
        raise CertError(f"--days must be 1 to {MAX_DAYS} (the run CA's own lifetime), got {days}")
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
    alt += [certified_host(host) for host in hosts]
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
    _write_files([(out / "tls.key", _key_pem(key), PRIVATE), (out / "tls.crt", cert.public_bytes(serialization.Encoding.PEM), PUBLIC),
                  (out / "ca.crt", ca_cert_path.read_bytes(), PUBLIC)])
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
    error, never skipped: a typo must not silently let a revoked certificate back in.
    Every line ends with a newline, the last one too: a last line without one is taken for a
    line still being written (a serial cut off mid-line is still valid hex, of another
    serial), and is an error. An empty file (0 bytes) holds no serial."""
    return parse_deny_list(path.read_bytes(), str(path))


def parse_deny_list(data: bytes, where: str) -> frozenset[int]:
    """``read_deny_list`` of a file's bytes; ``where`` names it in errors."""
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise CertError(f"{where}: not text ({exc.reason} at byte {exc.start})") from None
    lines = text.split("\n")
    if lines[-1]:
        raise CertError(f"{where}:{len(lines)}: the last line does not end with a newline (cut off mid-write?): "
                        f"{lines[-1].strip()[:80]!r}")
    serials = set()
    for n, line in enumerate(lines[:-1], 1):
        entry = line.split("#", 1)[0].strip().lower().removeprefix("0x")
        if not entry:
            continue
        try:
            serials.add(int(entry, 16))
        except ValueError:
            raise CertError(f"{where}:{n}: not a hexadecimal serial number: {line.strip()[:80]!r}") from None
    return frozenset(serials)


def setup_run(folder: pathlib.Path, learners: int, hosts: tuple[str, ...] = ()) -> list[str]:
    """A CA and the certificates of one run's services in ``folder``: the coordinator, the
    outer optimizer, an ``operator`` (the launcher's and health checks' read-only client),
    and a learner certificate for every id a run of ``learners`` (M) admits, ``learner-0``
    .. ``learner-<2M-1>`` (the coordinator's id range: the planned learners and one extra
    per shard, e.g. Compose's ``--scale``). What already exists is kept, so this is safe to
    repeat (a resumed run, a restarted Compose ``certs`` service); returns the names it
    issued now."""
    for host in hosts:
        certified_host(host)  # refused before anything is written
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
    _write_files([(out, json.dumps(doc, sort_keys=True).encode(), PRIVATE)])
    return out


def unbundle(bundle: pathlib.Path, name: str, into: pathlib.Path) -> pathlib.Path:
    """Write identity ``name`` of a bundle as an identity folder ``into`` (ca.crt, tls.crt,
    tls.key, the key 0600); ``into`` is made (mode 0700) if it does not exist."""
    import json

    try:
        doc = json.loads(bundle.read_text())
        entry = doc["identities"][name]
        ca, cert, key = doc["ca"], entry["cert"], entry["key"]
    except OSError as exc:
        raise CertError(f"{bundle}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError):
        raise CertError(f"{bundle}: holds no identity {name!r} (a bundle of `ddiloco certs setup`?)") from None
    if not into.is_dir():
        # a folder made here holds a key: its owner's only. A folder that exists (``--into .``)
        # is the caller's, and keeps the mode they gave it.
        try:
            into.mkdir(parents=True, mode=0o700)
            os.chmod(into, 0o700)  # mkdir's mode is cut by the umask
        except OSError as exc:
            raise CertError(f"--into {into}: cannot make the folder: {exc.strerror or exc}") from None
    _write_files([(into / "tls.key", key.encode(), PRIVATE), (into / "tls.crt", cert.encode(), PUBLIC),
                  (into / "ca.crt", ca.encode(), PUBLIC)])
    return into
