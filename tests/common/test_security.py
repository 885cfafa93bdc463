"""The typed ``Security`` of a service: secure unless explicitly not, and an identity folder
that is checked whole before anything serves with it."""

from __future__ import annotations

import argparse
import datetime
import shutil

import pytest

from ddiloco.common.certs import CertError, init_ca, issue
from ddiloco.common.security import Security, add_security_arguments, security_from_args


@pytest.fixture
def ca(tmp_path):
    init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def parse(*argv: str, revocation: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_security_arguments(parser, revocation=revocation)
    return parser.parse_args(argv)


def test_a_service_without_tls_or_an_explicit_opt_out_does_not_start():
    with pytest.raises(SystemExit, match="no --tls-dir"):
        security_from_args(parse(), "coordinator")


def test_insecure_is_explicit_and_carries_no_identity():
    sec = security_from_args(parse("--insecure"), "coordinator")
    assert not sec.enabled and sec.identity is None


def test_tls_and_insecure_together_are_refused(ca):
    with pytest.raises(SystemExit, match="not both"):
        security_from_args(parse("--insecure", "--tls-dir", str(ca)), "outer")


def test_an_identity_folder_loads_with_its_role(ca):
    issue(ca, "outer", "outer")
    sec = security_from_args(parse("--tls-dir", str(ca / "outer"), "--revoked", str(ca / "revoked.txt")), "outer")
    assert sec.enabled and sec.identity.role == "outer" and sec.revoked == ca / "revoked.txt"
    assert "PRIVATE" not in repr(sec)


def test_a_certificate_of_another_role_is_refused(ca):
    issue(ca, "learner-0", "learner")
    with pytest.raises(CertError, match="a learner's, this service is the coordinator"):
        Security.from_dir(ca / "learner-0", "coordinator")


def test_a_key_that_is_not_the_certificates_is_refused(ca):
    issue(ca, "outer", "outer")
    issue(ca, "coordinator", "coordinator")
    shutil.copy(ca / "coordinator" / "tls.key", ca / "outer" / "tls.key")
    with pytest.raises(CertError, match="not the key of tls.crt"):
        Security.from_dir(ca / "outer")


def test_a_certificate_of_another_ca_is_refused(ca, tmp_path):
    init_ca(tmp_path / "other")
    issue(tmp_path / "other", "outer", "outer")
    shutil.copy(ca / "ca.crt", tmp_path / "other" / "outer" / "ca.crt")
    with pytest.raises(CertError, match="not signed by ca.crt"):
        Security.from_dir(tmp_path / "other" / "outer")


def test_an_expired_certificate_is_refused(ca):
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    issue(ca, "outer", "outer", days=1, valid_from=past)
    with pytest.raises(CertError, match="not now"):
        Security.from_dir(ca / "outer")


def test_a_missing_file_is_named(ca):
    issue(ca, "outer", "outer")
    (ca / "outer" / "tls.key").unlink()
    with pytest.raises(CertError, match="cannot read tls.key"):
        Security.from_dir(ca / "outer")
