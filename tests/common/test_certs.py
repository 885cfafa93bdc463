"""``ddiloco certs``: a run CA, identities bound into certificates, private keys kept
private, revocation lists that refuse a typo rather than skip it."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest
from cryptography import x509

from ddiloco.common.certs import (
    CertError,
    identity_of,
    init_ca,
    issue,
    read_deny_list,
    revoke,
    role_host,
    setup_run,
    unbundle,
)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_readable_by_their_owner_only(tmp_path):
    init_ca(tmp_path)
    folder = issue(tmp_path, "coordinator", "coordinator")
    assert mode(tmp_path / "ca.key") == 0o600
    assert mode(folder / "tls.key") == 0o600
    assert (folder / "ca.crt").read_bytes() == (tmp_path / "ca.crt").read_bytes()


def test_a_learner_certificate_binds_its_learner_id_and_role(tmp_path):
    init_ca(tmp_path)
    folder = issue(tmp_path, "learner-7", "learner")
    cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
    ident = identity_of(cert)
    assert (ident.name, ident.role, ident.learner_id) == ("learner-7", "learner", 7)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert role_host("learner") in names and role_host("coordinator") not in names


def test_an_explicit_learner_id_wins_over_the_name(tmp_path):
    init_ca(tmp_path)
    folder = issue(tmp_path, "site-b", "learner", learner_id=3)
    assert identity_of(x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())).learner_id == 3


@pytest.mark.parametrize(
    "name, role, learner_id, message",
    [
        ("worker", "learner", None, "needs a learner id"),
        ("outer", "outer", 2, "only learner certificates"),
        ("x", "admin", None, "unknown role"),
        ("Bad Name", "outer", None, "lower-case"),
    ],
)
def test_issue_refuses_what_cannot_name_an_identity(tmp_path, name, role, learner_id, message):
    init_ca(tmp_path)
    with pytest.raises(CertError, match=message):
        issue(tmp_path, name, role, learner_id)


def test_an_empty_deny_list_is_never_an_empty_file(tmp_path):
    """Swarm refuses a secret of 0 bytes; the list itself is empty."""
    setup_run(tmp_path, 1)
    assert (tmp_path / "revoked.txt").stat().st_size > 0
    assert read_deny_list(tmp_path / "revoked.txt") == frozenset()


def test_init_refuses_to_replace_a_ca(tmp_path):
    init_ca(tmp_path)
    with pytest.raises(CertError, match="already holds a CA"):
        init_ca(tmp_path)


def test_setup_run_issues_every_learner_id_the_run_admits_and_keeps_what_exists(tmp_path):
    assert setup_run(tmp_path, 2) == ["coordinator", "outer", "operator", "learner-0", "learner-1", "learner-2", "learner-3"]
    key = (tmp_path / "learner-0" / "tls.key").read_bytes()
    assert setup_run(tmp_path, 3) == ["learner-4", "learner-5"]
    assert (tmp_path / "learner-0" / "tls.key").read_bytes() == key


def test_a_learner_takes_its_identity_from_the_bundle(tmp_path):
    setup_run(tmp_path / "tls", 1)
    folder = unbundle(tmp_path / "tls" / "learners.json", "learner-1", tmp_path / "mine")
    assert mode(tmp_path / "tls" / "learners.json") == 0o600 and mode(folder / "tls.key") == 0o600
    assert (folder / "tls.crt").read_bytes() == (tmp_path / "tls" / "learner-1" / "tls.crt").read_bytes()
    with pytest.raises(CertError, match="no identity 'learner-2'"):
        unbundle(tmp_path / "tls" / "learners.json", "learner-2", tmp_path / "other")


def test_revoke_lists_the_serial_once(tmp_path):
    setup_run(tmp_path, 1)
    serial = revoke(tmp_path, name="learner-0")
    assert revoke(tmp_path, serial=serial) == serial
    assert read_deny_list(tmp_path / "revoked.txt") == {serial}
    assert (tmp_path / "revoked.txt").read_text().count(f"{serial:x}") == 1


def test_a_malformed_deny_list_is_an_error_not_skipped(tmp_path):
    path = tmp_path / "revoked.txt"
    path.write_text("# revoked\nab12\nnot-hex\n")
    with pytest.raises(CertError, match=r"revoked.txt:3"):
        read_deny_list(path)


def test_the_command_line_never_prints_a_key(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddiloco", "certs", *a], capture_output=True, text=True, timeout=60)  # noqa: E731
    done = [run("setup", str(tmp_path), "--learners", "1"), run("issue", str(tmp_path), "--name", "learner-5", "--role", "learner"),
            run("show", str(tmp_path / "learner-5")), run("revoke", str(tmp_path), "--name", "learner-5")]
    assert [p.returncode for p in done] == [0, 0, 0, 0], [p.stderr for p in done]
    assert "learner 'learner-5' (learner 5)" in done[2].stdout
    printed = "".join(p.stdout + p.stderr for p in done)
    assert "PRIVATE KEY" not in printed
    for key in tmp_path.rglob("*.key"):
        body = "".join(key.read_text().splitlines()[1:-1])
        assert body[:40] not in printed
    bad = run("issue", str(tmp_path), "--name", "nobody", "--role", "learner")
    assert bad.returncode == 2 and bad.stderr.startswith("ddiloco certs: error: a learner certificate needs")
