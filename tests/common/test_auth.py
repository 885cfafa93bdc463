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
