"""The command line a person meets: every command and argument says what it is for."""

from __future__ import annotations

import argparse

from slurm_resilience.cli import COMMANDS, build_parser


def _undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {c.dest for c in action._choices_actions if c.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    out.append(f"{path} {name}")
                out += _undocumented(sub, f"{path} {name}")
        elif isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        elif not action.help or action.help == argparse.SUPPRESS:
            out.append(f"{path}: {'/'.join(action.option_strings) or action.dest}")
    return out


def test_every_command_and_argument_has_help_text() -> None:
    """`slurm-resilience ... --help` explains each command, positional and option."""
    missing = [m for name in COMMANDS
               for m in _undocumented(build_parser(only=name), "slurm-resilience")
               if m.startswith(f"slurm-resilience {name}")]
    assert missing == []


def test_the_guard_sees_an_argument_without_help() -> None:
    """The walk above finds an undocumented positional in a nested subcommand."""
    p = argparse.ArgumentParser()
    sub = p.add_subparsers().add_parser("x", help="x").add_subparsers()
    sub.add_parser("y", help="y").add_argument("node")
    assert _undocumented(p, "t") == ["t x y: node"]
