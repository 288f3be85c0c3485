"""Help of the command lines: every option of every subcommand of `estream`, `estream-pack`
and `estream-synth` says what it does, and `estream --help` shows the commands in the order a
model goes through them."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from estream_cli.main import WORKFLOW, build_parser


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _layout_parser(tool: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `estream-pack` / `estream-synth` builds, caught when it starts parsing."""
    from estream_layout import cli

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured) as got:
        getattr(cli, f"{tool}_main")([])
    return got.value.parser


def _walk(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.Action]]:
    """(command path, action) of every option and positional of ``parser`` and of every
    subcommand below it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(sub, f"{name} {sub_name}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


def _undocumented(parser: argparse.ArgumentParser, name: str) -> list[str]:
    return [
        f"{path}: {'/'.join(a.option_strings) or a.dest}"
        for path, a in _walk(parser, name)
        if not (a.help or "").strip() or a.help == argparse.SUPPRESS
    ]


def test_every_estream_option_has_help():
    """Each option and positional argument of each `estream` subcommand has a help text."""
    parser = build_parser()
    assert len(list(_walk(parser, "estream"))) > 100  # the walk reaches the subcommands
    assert _undocumented(parser, "estream") == []


@pytest.mark.parametrize("tool", ["pack", "synth"])
def test_every_layout_tool_option_has_help(tool, monkeypatch):
    """Each option of `estream-pack` and `estream-synth` has a help text."""
    parser = _layout_parser(tool, monkeypatch)
    assert parser.prog == f"estream-{tool}"
    assert len(parser._actions) > 5
    assert _undocumented(parser, parser.prog) == []


def test_walk_finds_an_option_without_help():
    """The check itself: an option added without help is reported, with its command path."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["prefill"].add_argument("--undocumented")
    assert _undocumented(parser, "estream") == ["estream prefill: --undocumented"]


def test_list_options_state_format_and_default():
    """Options taking a list say it is comma-separated and what the default is."""
    parser = build_parser()
    helps = {
        (path, a.option_strings[0]): a.help
        for path, a in _walk(parser, "estream")
        if a.option_strings
    }
    for key in [
        ("estream profile", "--candidates"),
        ("estream profile", "--queue-depths"),
        ("estream bench", "--lengths"),
        ("estream bench", "--modes"),
    ]:
        assert "comma-separated" in helps[key] and "default" in helps[key], key


def test_help_lists_commands_in_workflow_order(capsys):
    """`estream --help` shows the workflow (synth → pack → profile → config → prefill / tasks /
    eval), and the command list follows that order."""
    with pytest.raises(SystemExit) as got:
        build_parser().parse_args(["--help"])
    assert got.value.code == 0
    out = capsys.readouterr().out
    assert WORKFLOW.splitlines()[0] in out
    steps = [out.index(f"estream {c} ") for c in ("synth", "pack", "profile", "config", "prefill")]
    assert steps == sorted(steps)
    listed = [
        line.split()[0]
        for line in out.split("COMMAND\n", 1)[1].split("\n\n", 1)[0].splitlines()
        if line.startswith("    ") and not line.startswith("     ")
    ]
    order = ["synth", "pack", "profile", "config", "prefill", "classify", "score", "rerank"]
    assert [c for c in listed if c in order] == order
    assert listed.index("eval") < listed.index("bench")


def _parsers(
    parser: argparse.ArgumentParser, name: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_help_page_renders_every_option():
    """`estream … --help` of every subcommand renders (no stray % in a help text) and shows
    each of its options with its help."""
    pages = dict(_parsers(build_parser(), "estream"))
    assert {"estream prefill", "estream eval cloze", "estream bench"} <= set(pages)
    for name, parser in pages.items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if action.option_strings and action.help and action.help != argparse.SUPPRESS:
                first_words = " ".join(action.help.split()[:3])
                assert first_words in text, (name, action.option_strings, first_words)
