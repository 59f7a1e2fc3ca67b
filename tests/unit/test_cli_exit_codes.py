"""The CLI package's one exit-code table: every command's --help is rendered from it and lists only the codes
that command can return; nothing outside racer_batch/cli imports click. No Redis, no model."""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import racer_batch.cli.exit_codes as exit_codes
import racer_batch.cli.service as cli_service
from racer_batch.cli import main
from racer_batch.cli.exit_codes import CliExit, ExitCode, epilog

ROOT = Path(__file__).resolve().parents[2]

# what each command can return, beyond 0 (success), 1 (a bug), 2 (bad usage) and 130 (Ctrl-C)
OWN_CODES = {
    "generate": {3}, "bench": {3},
    "submit": {4, 5}, "status": {4}, "list": {4}, "cancel": {4}, "errors": {4}, "worker": {4},
    "report": {4}, "shadow": {3, 4}, "export": {4},
}


def _listed(help_text: str) -> list[tuple[int, str]]:
    """(code, text) per line of the help's ``Exit codes:`` block."""
    block = help_text.split("Exit codes:", 1)[1]
    rows = []
    for line in block.splitlines()[1:]:
        head, _, text = line.strip().partition("  ")
        if not head.isdigit():
            break
        rows.append((int(head), text))
    return rows


def test_the_table():
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130]
    assert len({c.meaning for c in ExitCode}) == len(ExitCode) and all(c.meaning for c in ExitCode)
    assert ExitCode.INPUT == click.UsageError("x").exit_code  # click's own usage errors are our 2
    res = doctest.testmod(exit_codes)
    assert res.attempted > 0 and res.failed == 0


def test_top_level_help_lists_the_whole_table():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    assert _listed(res.output) == [(int(c), c.meaning) for c in ExitCode]


@pytest.mark.parametrize("command", sorted(OWN_CODES))
def test_each_command_lists_its_own_codes_from_the_table(command):
    assert set(main.commands) == set(OWN_CODES)
    res = CliRunner().invoke(main, [command, "--help"])
    assert res.exit_code == 0, res.output
    listed = _listed(res.output)
    codes = [code for code, _ in listed]
    assert codes == sorted(codes) and set(codes) == {0, 1, 2, 130} | OWN_CODES[command]
    for code, text in listed:
        assert text.startswith(ExitCode(code).meaning), (command, code, text)


def test_epilog_refuses_a_code_listed_twice():
    with pytest.raises(ValueError, match="listed twice"):
        epilog(ExitCode.OK, (ExitCode.OK, "again"))


def test_cli_exit_carries_its_code():
    @click.command()
    def boom() -> None:
        raise CliExit("no such thing", ExitCode.SERVICE)

    res = CliRunner().invoke(boom, [])
    assert res.exit_code == 4 and "Error: no such thing" in res.output


def test_ctrl_c_that_no_command_handles_exits_130(monkeypatch):
    def interrupted(url: str, prefix: str):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_service, "_queue", interrupted)
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 130 and "interrupted" in res.output and "Aborted" not in res.output


def test_only_the_cli_package_imports_click():
    importers = []
    for path in sorted((ROOT / "racer_batch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "click" or n.startswith("click.") for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert importers and all(p.startswith("racer_batch/cli/") for p in importers), importers
