"""``--help`` of every command is readable in an 80-column terminal: each flag name whole, no line
wider than the terminal."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402
import typer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402


def _commands(group, path: tuple[str, ...] = ()):
    """Every (sub-)command under ``group`` with its path (typer's groups carry ``commands``)."""
    for name, command in sorted(group.commands.items()):
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    from fastdeploy_core.cli.main import build_app

    return build_app()


@pytest.fixture(scope="module")
def root(app):
    return typer.main.get_command(app)


def test_every_command_is_checked(root):
    names = {" ".join(path) for path, _ in _commands(root)}
    assert {"serve", "generate", "chat", "bench latency", "bench throughput", "bench serve", "env", "plugins"} <= names


def test_help_at_80_columns_shows_every_flag_name_whole(app, root):
    runner = CliRunner()
    for path, command in [((), root), *_commands(root)]:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert result.exit_code == 0, (path, result.output)
        lines = result.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), (path, [line for line in lines if len(line) > 80])
        assert "…" not in result.stdout, (path, result.stdout)
        words = set(result.stdout.replace(",", " ").replace("/", " ").split())
        for param in command.params:
            for flag in [*param.opts, *param.secondary_opts]:
                if flag.startswith("-"):
                    assert flag in words, (path, flag, result.stdout)
