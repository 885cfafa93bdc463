"""README's two set-up commands stay true, and CI runs exactly README's test command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _fenced_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick, re.S)]


def test_quick_start_has_exactly_two_commands_install_and_run_then_test():
    commands = _fenced_commands()
    assert len(commands) == 2
    install_and_run, test = commands
    assert "pip install torch==2.13.0" in install_and_run
    assert install_and_run.index("torch==2.13.0") < install_and_run.index("-e '.")  # torch first
    assert install_and_run.endswith("ddiloco run")
    assert "pytest" in test


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _fenced_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines
