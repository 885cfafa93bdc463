"""Authorization of one call from the caller's certificate, without a server: roles, a
learner acting only as itself, revocation through a reloaded deny list, fail closed."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ddiloco.common import auth, errors
from ddiloco.common.certs import init_ca, issue, revoke
from ddiloco.common.security import Security

POLICY = {"Push": auth.LEARNER, "Read": auth.ANY, "End": auth.COORDINATOR}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def ca(tmp_path):
    init_ca(tmp_path)
    for name, role in [("coordinator", "coordinator"), ("learner-0", "learner"), ("learner-1", "learner"), ("operator", "operator")]:
        issue(tmp_path, name, role)
    return tmp_path


def ctx(folder) -> dict:
    """What gRPC's auth context holds for a TLS peer that presented this certificate."""
    return {"transport_security_type": [b"ssl"], "x509_pem_cert": [(folder / "tls.crt").read_bytes()]}


def authorizer(ca, clock=None) -> auth.Authorizer:
    sec = Security.from_dir(ca / "coordinator", revoked=ca / "revoked.txt")
    return auth.Authorizer(sec, POLICY, clock or Clock())


def test_a_role_admitted_by_the_policy_passes_and_is_named(ca):
    ident = authorizer(ca).check(ctx(ca / "learner-0"), "Push", learner_id=0)
    assert (ident.role, ident.learner_id) == ("learner", 0)
    assert authorizer(ca).check(ctx(ca / "operator"), "Read").role == "operator"


def test_a_learner_acting_as_another_learner_is_denied(ca):
    with pytest.raises(errors.PermissionDenied, match="acts only as learner 0, not as learner 1"):
        authorizer(ca).check(ctx(ca / "learner-0"), "Push", learner_id=1)


def test_a_role_outside_the_policy_is_denied(ca):
    with pytest.raises(errors.PermissionDenied, match="may not call End"):
        authorizer(ca).check(ctx(ca / "learner-0"), "End")


def test_a_method_missing_from_the_policy_is_denied_to_everyone(ca):
    with pytest.raises(errors.PermissionDenied, match="allowed: nobody"):
        authorizer(ca).check(ctx(ca / "coordinator"), "Unlisted")


def test_a_call_without_a_client_certificate_is_unauthenticated(ca):
    with pytest.raises(errors.Unauthenticated, match="no client certificate"):
        authorizer(ca).check({"transport_security_type": [b"ssl"]}, "Read")


def test_a_certificate_with_an_unknown_role_is_denied(ca):
    ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "root"),
                                 x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "admin")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(ca_cert.not_valid_before_utc).not_valid_after(ca_cert.not_valid_after_utc)
        .sign(ca_key, hashes.SHA256())
    )
    with pytest.raises(errors.PermissionDenied, match="unknown role 'admin'"):
        authorizer(ca).check({"x509_pem_cert": [cert.public_bytes(serialization.Encoding.PEM)]}, "Read")


def test_a_revoked_certificate_is_refused_once_the_deny_list_is_reloaded(ca):
    clock = Clock()
    a = authorizer(ca, clock)
    a.check(ctx(ca / "learner-1"), "Push", learner_id=1)
    revoke(ca, name="learner-1")
    clock.t += auth.DENY_RELOAD_S  # the list is looked at again at most this often
    with pytest.raises(errors.Unauthenticated, match="is revoked"):
        a.check(ctx(ca / "learner-1"), "Push", learner_id=1)
    a.check(ctx(ca / "learner-0"), "Push", learner_id=0)  # the others go on


def test_a_deny_list_that_turns_malformed_keeps_the_previous_one(ca):
    clock = Clock()
    a = authorizer(ca, clock)
    revoke(ca, name="learner-1")
    clock.t += auth.DENY_RELOAD_S
    with pytest.raises(errors.Unauthenticated):
        a.check(ctx(ca / "learner-1"), "Read")
    with open(ca / "revoked.txt", "a") as f:
        f.write("half-written line\n")
    clock.t += auth.DENY_RELOAD_S
    with pytest.raises(errors.Unauthenticated):
        a.check(ctx(ca / "learner-1"), "Read")


def revoked(a: auth.Authorizer, folder) -> bool:
    try:
        a.check(ctx(folder), "Read")
    except errors.Unauthenticated:
        return True
    return False


def deny_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == auth.__name__ and r.levelname == "ERROR"]


def test_a_deny_list_that_goes_missing_keeps_its_revocations_and_says_so_once(ca, caplog):
    """A deny list renamed away, deleted or unreadable was read as an empty list: every
    revoked certificate was let back in. The list in force stays, and the episode is logged
    once, not at every reload."""
    clock = Clock()
    a = authorizer(ca, clock)
    revoke(ca, name="learner-1")
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1")
    (ca / "revoked.txt").rename(ca / "revoked.moved")
    for _ in range(3):
        clock.t += auth.DENY_RELOAD_S
        assert revoked(a, ca / "learner-1")
    assert len(deny_errors(caplog)) == 1 and "cannot read it" in deny_errors(caplog)[0]
    (ca / "revoked.moved").rename(ca / "revoked.txt")
    revoke(ca, name="learner-0")
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-0") and revoked(a, ca / "learner-1")
    (ca / "revoked.txt").unlink()  # a new episode is logged again
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1") and len(deny_errors(caplog)) == 2


def test_a_serial_cut_off_mid_line_never_replaces_the_list(ca, caplog):
    """A serial written half way is still hexadecimal (of another serial): a last line
    without its newline is a write in progress, and the whole file waits for it."""
    clock = Clock()
    a = authorizer(ca, clock)
    revoke(ca, name="learner-1")
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1")
    line = f"{x509.load_pem_x509_certificate((ca / 'learner-0' / 'tls.crt').read_bytes()).serial_number:x}\n"
    with open(ca / "revoked.txt", "a") as f:
        f.write(line[:7])
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1") and not revoked(a, ca / "learner-0")
    assert "does not end with a newline" in deny_errors(caplog)[0]
    with open(ca / "revoked.txt", "a") as f:
        f.write(line[7:])
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1") and revoked(a, ca / "learner-0")


def test_an_empty_file_keeps_the_list_and_a_comment_line_lifts_every_revocation(ca):
    """0 bytes is what a writer that truncates before writing leaves for a moment; an
    operator who lifts every revocation writes a file of no serial but a comment (as
    ``certs init`` does), which takes effect once it has stayed unchanged for a reload."""
    clock = Clock()
    a = authorizer(ca, clock)
    revoke(ca, name="learner-1")
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1")
    (ca / "revoked.txt").write_text("")
    for _ in range(2):
        clock.t += auth.DENY_RELOAD_S
        assert revoked(a, ca / "learner-1")
    (ca / "revoked.txt").write_text("# nothing revoked\n")
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-1")  # seen once: it may be a rewrite in progress
    clock.t += auth.DENY_RELOAD_S
    assert not revoked(a, ca / "learner-1")


def test_a_rewrite_seen_half_done_at_a_line_lifts_nothing(ca):
    """A rewrite in place (truncate, then write) can be read as a prefix of the new file
    that ends at a line: the serials it lacks stay revoked unless the file stays so."""
    clock = Clock()
    a = authorizer(ca, clock)
    revoke(ca, name="learner-1")
    revoke(ca, name="learner-0")
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-0") and revoked(a, ca / "learner-1")
    whole = (ca / "revoked.txt").read_text()
    (ca / "revoked.txt").write_text(whole[: whole.rindex("\n", 0, len(whole) - 1) + 1])  # without learner-0's line
    clock.t += auth.DENY_RELOAD_S
    assert revoked(a, ca / "learner-0")
    (ca / "revoked.txt").write_text(whole + "# edited\n")  # the rewrite completes
    for _ in range(2):
        clock.t += auth.DENY_RELOAD_S
        assert revoked(a, ca / "learner-0") and revoked(a, ca / "learner-1")


def test_without_tls_every_call_is_admitted_and_nobody_is_known():
    assert auth.Authorizer(Security.insecure(), POLICY).check({}, "End") is None


def test_every_method_of_every_service_has_a_policy_and_nothing_else_does():
    """Fail closed is a backstop, not the plan: each RPC says who may call it."""
    from ddiloco.coordinator.service import POLICY as COORDINATOR_POLICY
    from ddiloco.learner.worker import POLICY as LEARNER_POLICY
    from ddiloco.outer.service import POLICY as OUTER_POLICY
    from ddiloco.v1 import coordinator_pb2, learner_pb2, outer_pb2

    for pb, service, policy in [(coordinator_pb2, "Coordinator", COORDINATOR_POLICY),
                                (outer_pb2, "OuterOptimizer", OUTER_POLICY), (learner_pb2, "Learner", LEARNER_POLICY)]:
        methods = {m.name for m in pb.DESCRIPTOR.services_by_name[service].methods}
        assert set(policy) == methods, service
        assert all(roles and roles <= auth.ANY for roles in policy.values()), service
