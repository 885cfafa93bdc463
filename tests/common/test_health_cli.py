"""`ddiloco health --timeout` is a positive, finite number of seconds up to an hour: -1, nan
and 1e18 were taken and reported as DEADLINE_EXCEEDED, as if the service had not answered."""

from __future__ import annotations

import pytest

from ddiloco import cli
from ddiloco.common import health


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e18", "3601"])
def test_a_timeout_no_health_check_takes_is_refused_before_asking(monkeypatch, capsys, value):
    def asked(*_a, **_k):
        raise AssertionError("the service was asked")

    monkeypatch.setattr(health, "_ask", asked)
    with pytest.raises(SystemExit) as exc:
        cli.main(["health", "127.0.0.1:1", "--timeout", value])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"ddiloco health: error: argument --timeout: seconds above 0 to 3600 (1 hour), got {value}\n"


def test_a_timeout_in_range_is_taken():
    assert health.timeout("0.5") == 0.5 and health.timeout("3600") == 3600
