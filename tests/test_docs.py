"""Docs that cannot rot: every ``--flag`` README.md and the pages under docs/ (and
cluster/README.md) show for one of this project's commands (its bench scripts run with
``bash bench/NAME.sh`` too) exists in that command's ``--help``, and every relative link points to a file that exists.

A flag belongs to the command named before it in the same code span or block line
(``python tune_driver.py --space smart``); a span that starts with a flag (```--budget
small```, or a ``... --concurrent 8`` continuation) belongs to the command the page
named last.  Commands of other tools (``mlflow ui``, ``pip``, ``ray``, ``nvidia-smi``)
are not checked.  Every bench command a page gives anywhere, prose too (``python -m
bench.NAME``, ``python bench/NAME.py``, ``bash bench/NAME.sh``), names a script that exists
and answers ``--help``.  Each ``--help`` runs once per session, all of them at once.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: pages checked for flags and links; CHANGELOG.md for links only (it may name
#: flags that have since been removed)
PAGES = sorted([REPO / "README.md", REPO / "cluster" / "README.md",
                *(p for p in (REPO / "docs").rglob("*.md"))])
LINK_PAGES = PAGES + [REPO / "CHANGELOG.md"]

#: the project's commands: how the docs name them -> the argv that prints its help
COMMAND = re.compile(r"python3?\s+(?:-m\s+(mtbert\.train|bench\.[a-z_]+)\b|(tune_driver\.py)\b|"
                     r"(bench/[a-z_]+\.py)\b)|bash\s+(bench/[a-z_]+\.sh)\b")
#: a bench command anywhere on a page (a line break may fall inside it)
BENCH_COMMAND = re.compile(r"python3?\s+(?:-m\s+(bench\.[a-z_]+)\b|(bench/[a-z_]+\.py)\b)|"
                           r"bash\s+(bench/[a-z_]+\.sh)\b")
FLAG = re.compile(r"(?<![\w/.-])--[a-z][a-z0-9-]*")
OTHER_TOOL = re.compile(r"(?:^|[\s(\[])(?:[A-Z_]+=\S+\s+)*(?:mlflow|pip|ray|nvidia-smi|docker|"
                        r"kubectl|helm|git|bash|pytest|python3?\s+-m\s+(?:pytest|pip|venv))\s")


def _help_argv(command: str) -> list[str]:
    if command.endswith(".sh"):  # a bench script: bash bench/NAME.sh
        return ["bash", str(REPO / command), "--help"]
    if not command.endswith(".py"):  # a module: mtbert.train, bench.NAME
        return [sys.executable, "-m", command, "--help"]
    return [sys.executable, str(REPO / command), "--help"]


def _command_file(command: str) -> Path:
    """The file a command runs: tune_driver.py, bench/NAME.py, mtbert/train.py."""
    if command.endswith((".py", ".sh")):
        return REPO / command
    return REPO / (command.replace(".", "/") + ".py")


@functools.lru_cache(maxsize=None)
def _helps(commands: frozenset[str]) -> dict[str, str]:
    """``--help`` of each command, the processes started together (each imports torch)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    procs = {c: subprocess.Popen(_help_argv(c), cwd=REPO, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for c in sorted(commands)}
    out = {}
    for c, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{c} --help exited {proc.returncode}:\n{text[-2000:]}"
        out[c] = text
    return out


def code_texts(markdown: str) -> list[str]:
    """The code blocks and inline code spans of a Markdown page, in page order."""
    parts, pos = [], 0
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M):
        parts.extend(re.findall(r"`([^`\n]+)`", markdown[pos:m.start()]))
        parts.append(m.group(1))
        pos = m.end()
    parts.extend(re.findall(r"`([^`\n]+)`", markdown[pos:]))
    return parts


def _commands_in_code(code: str):
    """(command or None, text of its arguments) per shell segment of a code text."""
    code = re.sub(r"\\\n\s*", " ", code)  # backslash continuations
    for line in code.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)  # comments
        for segment in re.split(r"&&|\|\||;|\|", line):
            if not segment.strip():
                continue
            found = list(COMMAND.finditer(segment))
            if not found and OTHER_TOOL.search(segment):
                yield "other", ""
                continue
            if not found:
                yield None, segment
                continue
            prefix = segment[:found[0].start()]
            if prefix.strip():  # another tool's arguments before the command are its own
                yield ("other", "") if OTHER_TOOL.search(prefix) else (None, prefix)
            for i, m in enumerate(found):
                end = found[i + 1].start() if i + 1 < len(found) else len(segment)
                yield next(g for g in m.groups() if g), segment[m.end():end]


#: the flags of a span that names no command (```--budget small```) must be options of
#: one of the project's commands; ANY stands for "any of them" in flags_by_command
ANY = "any project command"


def flags_by_command(markdown: str) -> list[tuple[str, str]]:
    """(command, --flag) for every flag the page's code names: a flag after a project
    command belongs to it; a '...' continuation to the command named last; a flag in a
    span that names no command to ANY; flags of other tools are left out."""
    out, current = [], None
    for code in code_texts(markdown):
        for command, args in _commands_in_code(code):
            if command == "other":
                continue
            if command is not None:
                current = command
                out.extend((command, f) for f in FLAG.findall(args))
            elif args.lstrip().startswith(("...", "…")) and current:
                out.extend((current, f) for f in FLAG.findall(args))
            else:
                out.extend((ANY, f) for f in FLAG.findall(args))
    return out


def unknown_flags(markdown: str, helps: dict[str, str], page: str = "<doc>") -> list[str]:
    """One line per flag the page names that its command's ``--help`` does not list."""
    def listed(flag: str, text: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None

    problems = []
    for command, flag in flags_by_command(markdown):
        texts = list(helps.values()) if command == ANY else [helps.get(command, "")]
        if not any(listed(flag, t) for t in texts):
            where = (f"any of {', '.join(sorted(helps))}" if command == ANY else command)
            problems.append(f"{page}: {flag} is not an option of {where} (not in its --help)")
    return problems


def broken_links(page: Path) -> list[str]:
    """Relative links and images of a page whose target file does not exist."""
    problems = []
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            problems.append(f"{page.relative_to(REPO)}: link to {target} (no such file)")
    return problems


def bench_commands(pages: list[Path] = PAGES, root: Path = REPO) -> dict[str, list[str]]:
    """Each bench command the pages give, code or prose -> the pages that give it."""
    found: dict[str, list[str]] = {}
    for page in pages:
        for m in BENCH_COMMAND.finditer(page.read_text(encoding="utf-8")):
            pages_of = found.setdefault(next(g for g in m.groups() if g), [])
            if str(page.relative_to(root)) not in pages_of:
                pages_of.append(str(page.relative_to(root)))
    return found


def _all_commands() -> frozenset[str]:
    """The project commands the pages name (tune_driver.py and mtbert.train always, the
    commands a flag of ANY is looked up in, every bench command of a page)."""
    return frozenset({"tune_driver.py", "mtbert.train"} |
                     {c for p in PAGES for c, _ in flags_by_command(p.read_text(encoding="utf-8"))
                      if c != ANY} | set(bench_commands()))


def test_every_flag_the_docs_name_exists():
    helps = _helps(_all_commands())
    problems = []
    for page in PAGES:
        problems += unknown_flags(page.read_text(encoding="utf-8"), helps,
                                  str(page.relative_to(REPO)))
    assert not problems, "\n".join(problems)


def test_every_command_the_docs_show_exists():
    missing = [c for c in _all_commands() if not _command_file(c).exists()]
    assert not missing, f"the docs show commands that do not exist: {missing}"


def test_every_bench_command_the_docs_give_runs():
    """A page that names a bench script that is gone fails here, page by page; the others
    answer ``--help`` (one process each, shared with the flags' check)."""
    commands = bench_commands()
    gone = sorted({f"{page}: {c} (no such script)" for c, pages in commands.items()
                   if not _command_file(c).exists() for page in pages})
    assert not gone, "\n".join(gone)
    assert set(commands) <= set(_helps(_all_commands()))  # each exited 0 on --help


def test_a_gone_bench_script_is_reported(tmp_path):
    (tmp_path / "page.md").write_text(
        "Run `python -m bench.throughput --steps 3`, then python -m\nbench.gone_study and "
        "`bash bench/gpu_evidence.sh`; python3 bench/old.py once.\n")
    commands = bench_commands([tmp_path / "page.md"], tmp_path)
    assert commands == dict.fromkeys(["bench.throughput", "bench.gone_study",
                                      "bench/gpu_evidence.sh", "bench/old.py"], ["page.md"])
    assert [c for c in commands if not _command_file(c).exists()] == ["bench.gone_study",
                                                                      "bench/old.py"]


def test_every_relative_link_points_to_a_file():
    problems = [p for page in LINK_PAGES for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_a_renamed_flag_is_reported():
    helps = {"tune_driver.py": "usage: tune_driver.py [--space SPACE] [--budget B]\n",
             "bench.throughput": "usage: throughput.py [--steps N] [--concurrent N]\n"}
    doc = ("Run `python tune_driver.py --space smart --budgett small`; `--budget full`,\n"
           "`--sapce x`.\n"
           "```bash\npython -m bench.throughput --steps 3 \\\n    --concurent 8\n```\n"
           "and `... --steps 4 --warmup 2`; `mlflow ui --host 127.0.0.1 --port 5000` is\n"
           "another tool.\n")
    problems = unknown_flags(doc, helps, "docs/x.md")
    assert problems == [
        "docs/x.md: --budgett is not an option of tune_driver.py (not in its --help)",
        "docs/x.md: --sapce is not an option of any of bench.throughput, tune_driver.py "
        "(not in its --help)",
        "docs/x.md: --concurent is not an option of bench.throughput (not in its --help)",
        "docs/x.md: --warmup is not an option of bench.throughput (not in its --help)",
    ]


def test_a_broken_link_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](here.md#part) [web](https://x.org) [top](#a) [gone](../gone.md)\n")
    assert broken_links(page) == ["docs/page.md: link to ../gone.md (no such file)"]
