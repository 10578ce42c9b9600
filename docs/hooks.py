"""MkDocs hooks for the afabric docs site (mkdocs.yml names this file).

- Docstrings use Sphinx roles (:class:`~afabric.Engine`); the rendered HTML shows the
  target's name as code instead of the role's markup.
- ``<!-- afabric-cli-help -->`` in a page is replaced by the ``--help`` text of every
  ``afabric`` command, taken from the installed package's argument parser at build time,
  so the CLI reference cannot drift from the CLI.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|attr|exc|mod|data|obj):<code>(~?)([^<]*)</code>")
_CLI_MARK = "<!-- afabric-cli-help -->"


def _commands(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[list[str], str]]:
    out = [(path, parser.format_help())]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, [*path, name])
    return out


def _cli_help() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: a fixed width here
    from afabric import cli

    parts = []
    for path, text in _commands(cli._parser(), ["afabric"]):
        parts.append(f"### `{' '.join(path)}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if _CLI_MARK in markdown:
        markdown = markdown.replace(_CLI_MARK, _cli_help())
    return markdown


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)
