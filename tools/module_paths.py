#!/usr/bin/env python
"""Rewrite references to the trainer's modules from their old flat paths to their folders.

    python tools/module_paths.py FILE...                 # every reference in the files
    python tools/module_paths.py --imports-only FILE...  # import statements only

Until 2026-11-29 the trainer's modules sat flat in ``mtbert/`` (``mtbert.trainer``,
``mtbert/trial_run.py``); now each is in the folder of its layer (``mtbert.loop.trainer``,
``mtbert/run/trial_run.py``; docs/architecture.md, "Layers").  The map is read from the
tree: every module of the folders below.  Rewritten: dotted paths (``mtbert.smart``,
``mtbert.smart.SmartRegulariser``), file paths (``mtbert/smart.py``) and ``from mtbert
import graph_reuse``.  A path already in its folder is left as it is, so a second run
changes nothing.  ``--imports-only`` touches only the lines of import statements (a branch
that edits a module's other lines merges with fewer conflicts).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtbert"
#: the folders the flat modules went to (data/ and tune/ were folders before)
FOLDERS = ["core", "model", "techniques", "run", "step", "loop"]


def module_folders(root: Path = PACKAGE) -> dict[str, str]:
    """Each moved module's name -> its folder."""
    return {p.stem: folder for folder in FOLDERS for p in sorted((root / folder).glob("*.py"))
            if p.stem != "__init__"}


def rewriter(folders: dict[str, str]):
    names = "|".join(sorted(folders, key=len, reverse=True))
    # a name that is also a folder (model) followed by one of that folder's modules is new
    inside = {f: "|".join(n for n, g in folders.items() if g == f) for f in FOLDERS}
    dotted = re.compile(rf"(?<![\w.])mtbert\.({names})\b")
    path = re.compile(rf"(?<![\w/])mtbert/({names})\.py\b")
    from_import = re.compile(r"^(\s*)from mtbert import ([\w, ]+?)(\s*(?:#.*)?)$", re.M)

    def sub_dotted(m: re.Match) -> str:
        name, rest = m.group(1), m.string[m.end():]
        if name in inside and re.match(rf"\.({inside[name]})\b", rest):
            return m.group(0)   # mtbert.model.model: already in its folder
        return f"mtbert.{folders[name]}.{name}"

    def sub_from(m: re.Match) -> str:
        imported = [n.strip() for n in m.group(2).split(",")]
        homes = {folders.get(n) for n in imported}
        if len(homes) != 1 or None in homes:
            return m.group(0)
        return f"{m.group(1)}from mtbert.{homes.pop()} import {m.group(2)}{m.group(3)}"

    def rewrite(text: str) -> str:
        text = dotted.sub(sub_dotted, text)
        text = path.sub(lambda m: f"mtbert/{folders[m.group(1)]}/{m.group(1)}.py", text)
        return from_import.sub(sub_from, text)
    return rewrite


def import_lines(text: str) -> set[int]:
    """The 0-based numbers of the lines that import statements span."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno - 1, (node.end_lineno or node.lineno)))
    return lines


def rewrite_file(path: Path, rewrite, imports_only: bool) -> bool:
    text = path.read_text(encoding="utf-8")
    if imports_only:
        lines = text.splitlines(keepends=True)
        for i in sorted(import_lines(text)):
            lines[i] = rewrite(lines[i])
        new = "".join(lines)
    else:
        new = rewrite(text)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--imports-only", action="store_true",
                        help="rewrite the lines of import statements only (.py files)")
    args = parser.parse_args(argv)
    rewrite = rewriter(module_folders())
    changed = [f for f in args.files if rewrite_file(f, rewrite, args.imports_only)]
    for f in changed:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
