"""`strata --help` names every command and bench tool, and every flag of every command has a help
text that states its default (or says what leaving it out means)."""

import argparse
import contextlib
import importlib
import io

import pytest

from services import cli
from services.bench.__main__ import TOOLS

COMMANDS = {name: (module, []) for name, (module, _) in cli.SUBCOMMANDS.items() if name not in ("bench", "model")}
COMMANDS["model init"] = ("services.default_model.cli", ["init"])
COMMANDS.update({f"bench {name}": (module, []) for name, (module, _) in TOOLS.items()})


def test_strata_help_lists_every_command_and_bench_tool(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in (*cli.SUBCOMMANDS, *TOOLS):
        assert f"\n  {name} " in out, name


class _Parsed(Exception):
    pass


def parsers_of(module_name: str, argv: list[str], monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers a command builds, caught at parse_args (nothing runs)."""
    caught = []

    def catch(parser, *args, **kwargs):
        caught.append(parser)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(_Parsed):
        importlib.import_module(module_name).main(argv)
    subparsers = [choice for parser in caught for action in parser._actions
                  if isinstance(action, argparse._SubParsersAction) for choice in action.choices.values()]
    return caught + subparsers


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_stating_its_default(command, monkeypatch):
    module_name, argv = COMMANDS[command]
    missing = []
    for parser in parsers_of(module_name, argv, monkeypatch):
        description = parser.description or ""
        assert not description or description.rstrip().endswith((".", ":", ")")) or "\n" in description, \
            f"{command}: description cut mid-sentence: {description!r}"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help:
                missing.append(f"{name}: no help")
            elif (action.option_strings and not action.required and not isinstance(action, argparse._StoreTrueAction)
                  and action.default not in (None, False) and "default" not in action.help):
                missing.append(f"{name}: default {action.default!r} not stated")
    assert not missing, f"strata {command}: " + "; ".join(missing)
