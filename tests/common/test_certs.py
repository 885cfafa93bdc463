"""``ddiloco certs``: a run CA, identities bound into certificates, private keys kept
private, revocation lists that refuse a typo rather than skip it."""

from __future__ import annotations

import pathlib
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


FAILING_WRITE = """
import pathlib, resource, signal, sys
from ddiloco.common import certs
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk fails
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
folder = pathlib.Path(sys.argv[1])
try:
    if sys.argv[3] == "issue":
        certs.issue(folder, "coordinator", "coordinator")
    else:
        certs.write_bundle(folder, ["learner-0", "learner-1"], folder / "learners.json")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("limit", [200, 600], ids=["the key's write fails", "the certificate's write fails after the key's"])
def test_a_write_that_fails_leaves_the_old_identity_loadable(tmp_path, limit):
    """Issuing a name again (rotation) deleted the old key before writing the new one: a
    full disk left the service with no key. Now nothing is replaced unless every file was
    written whole, key and certificate together."""
    from ddiloco.common.security import Security

    setup_run(tmp_path, 0)
    before = Security.from_dir(tmp_path / "coordinator", "coordinator")
    done = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(tmp_path), str(limit), "issue"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("CertError cannot write"), done.stdout + done.stderr
    after = Security.from_dir(tmp_path / "coordinator", "coordinator")
    assert after.identity == before.identity and after.key_pem == before.key_pem
    assert sorted(p.name for p in (tmp_path / "coordinator").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]


def test_a_bundle_whose_write_fails_stays_the_old_bundle(tmp_path):
    setup_run(tmp_path, 1)
    before = (tmp_path / "learners.json").read_bytes()
    done = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(tmp_path), "1000", "bundle"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("CertError cannot write"), done.stdout + done.stderr
    assert (tmp_path / "learners.json").read_bytes() == before
    assert mode(tmp_path / "learners.json") == 0o600


def test_a_key_is_never_readable_by_others_even_before_it_is_in_place(tmp_path, monkeypatch):
    import os

    from ddiloco.common import certs

    renamed = {}
    real_replace = os.replace

    def replace(src, dst):
        renamed[pathlib.Path(dst).name] = mode(pathlib.Path(src))
        real_replace(src, dst)

    monkeypatch.setattr(certs.os, "replace", replace)
    setup_run(tmp_path, 0)
    assert renamed["ca.key"] == renamed["tls.key"] == renamed["learners.json"] == 0o600


def certs_command(*argv: str) -> tuple[int, str]:
    import argparse
    import contextlib
    import io

    from ddiloco.common import certs_cli

    parser = argparse.ArgumentParser()
    certs_cli.add_arguments(parser)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = certs_cli.main(parser.parse_args(list(argv)))
    return rc, err.getvalue()


def test_an_internationalized_host_is_certified_in_its_ascii_form(tmp_path):
    init_ca(tmp_path)
    assert certs_command("issue", str(tmp_path), "--name", "outer", "--role", "outer", "--host", "bücher.example") == (0, "")
    cert = x509.load_pem_x509_certificate((tmp_path / "outer" / "tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "xn--bcher-kva.example" in names


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--host", "a..b"], "--host 'a..b': not an IP address or a DNS name"),
        (["--host=-x.example"], "--host '-x.example': not an IP address or a DNS name"),
        (["--host", "straße.example"], "--host 'straße.example': its ASCII form is ambiguous"),
        (["--days", "100000000"], "--days must be 1 to 3650 (the run CA's own lifetime), got 100000000"),
        (["--days", "0"], "--days must be 1 to 3650"),
    ],
)
def test_issue_refuses_a_host_or_validity_it_cannot_certify_in_one_line(tmp_path, flags, message):
    init_ca(tmp_path)
    rc, err = certs_command("issue", str(tmp_path), "--name", "outer", "--role", "outer", *flags)
    assert rc == 2 and err.startswith(f"ddiloco certs: error: {message}") and len(err.splitlines()) == 1
    assert not (tmp_path / "outer").exists() or not any((tmp_path / "outer").iterdir())


def test_setup_refuses_a_bad_host_before_writing_anything(tmp_path):
    rc, err = certs_command("setup", str(tmp_path / "tls"), "--learners", "1", "--host", "a b")
    assert rc == 2 and "--host 'a b'" in err
    assert not (tmp_path / "tls").exists()


def test_unbundle_makes_its_folder_private_and_leaves_an_existing_one_as_it_is(tmp_path):
    import os

    setup_run(tmp_path / "tls", 1)
    made = unbundle(tmp_path / "tls" / "learners.json", "learner-0", tmp_path / "new" / "learner")
    assert mode(made) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)  # e.g. `--into .`
    unbundle(tmp_path / "tls" / "learners.json", "learner-1", shared)
    assert mode(shared) == 0o755 and mode(shared / "tls.key") == 0o600


def test_a_deny_list_whose_last_line_is_cut_off_is_an_error_and_revoke_adds_nothing_to_it(tmp_path):
    """A serial cut off mid-line is still hexadecimal (of another serial): every line of the
    list ends with a newline, and revoke never appends to a line still being written."""
    setup_run(tmp_path, 1)
    path = tmp_path / "revoked.txt"
    with open(path, "a") as f:
        f.write("ab1")
    with pytest.raises(CertError, match=r"revoked.txt:2: the last line does not end with a newline"):
        read_deny_list(path)
    with pytest.raises(CertError, match="does not end with a newline"):
        revoke(tmp_path, name="learner-0")
    assert path.read_text().endswith("ab1")
    path.write_text("")  # 0 bytes: a list of no serial (servers keep one in force: common/auth.py)
    assert read_deny_list(path) == frozenset()
