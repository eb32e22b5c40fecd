"""The lessons in docs/ run: every ```console runnable fence is executed and its output compared.

Convention (documented in docs/README.md): in a fence whose info string is
``console runnable``, a line starting with ``$ `` is a command, run from the
repository root; the lines after it, up to the next command, are its output
(stdout and stderr together). A line ``...`` matches any number of lines.
Trailing spaces are ignored. A figure ``![..](figures/NAME)`` must be written
by a runnable command in the same lesson.

Commands run in a scratch copy of the tree (links to the real files, an
empty docs/figures), so the test never rewrites the committed figures.
``allreduce-explain`` and ``python`` scripts run in this process (no numba
start-up per command); anything else runs in a shell.

    python tests/test_docs.py --update     # rewrite the outputs of fences without '...' lines
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```console runnable\n(.*?)^```", re.M | re.S)


def lessons() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def commands(text: str) -> list[tuple[str, list[str]]]:
    """``[(command, expected output lines)]`` of every runnable fence in ``text``."""
    out: list[tuple[str, list[str]]] = []
    for block in FENCE.findall(text):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif out:
                out[-1][1].append(line.rstrip())
    return out


def matches(expected: list[str], got: list[str]) -> bool:
    """Line by line; ``...`` matches any run of lines (including none)."""
    if not expected:
        return not got
    if expected[0] == "...":
        return any(matches(expected[1:], got[i:]) for i in range(len(got) + 1))
    return bool(got) and expected[0] == got[0] and matches(expected[1:], got[1:])


def _in_process(argv: list[str]) -> bool:
    return argv[0] == "allreduce-explain" or (argv[0] == "python" and len(argv) > 1 and
                                             (argv[1].endswith(".py") or argv[1:3] == ["-m", "allreduce.explain"]))


def run(command: str, cwd: Path) -> tuple[int, list[str]]:
    """Run one documented command; ``(exit code, output lines)``."""
    argv = shlex.split(command)
    if not _in_process(argv) or any(c in command for c in "|><;&"):
        env = dict(os.environ, PYTHONPATH=str(cwd) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=False, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        return proc.returncode, [line.rstrip() for line in proc.stdout.splitlines()]
    buf, old_cwd, old_argv, code = io.StringIO(), os.getcwd(), sys.argv, 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                if argv[0] == "allreduce-explain" or argv[1] == "-m":
                    from allreduce.explain.__main__ import main
                    code = main(argv[1:] if argv[0] == "allreduce-explain" else argv[3:])
                else:
                    sys.argv = argv[1:]
                    runpy.run_path(argv[1], run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(old_cwd)
        sys.argv = old_argv
    return code or 0, [line.rstrip() for line in buf.getvalue().splitlines()]


def sandbox(tmp: Path) -> Path:
    """A scratch tree: links to the repository's entries, docs/examples linked, docs/figures empty."""
    tmp.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", ".git"):
            (tmp / entry.name).symlink_to(entry)
    (tmp / "docs").mkdir()
    (tmp / "docs" / "figures").mkdir()
    for entry in DOCS.iterdir():
        if entry.name != "figures":
            (tmp / "docs" / entry.name).symlink_to(entry)
    return tmp


@pytest.fixture
def default_costmodel(tmp_path, monkeypatch):
    """The printed cost-model numbers use select.py's DEFAULTS, not constants fitted on this machine."""
    from allreduce.algorithms import select
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ALLREDUCE_COSTMODEL", raising=False)
    select.clear_cache()
    yield
    select.clear_cache()


@pytest.mark.parametrize("lesson", lessons(), ids=lambda p: p.name)
def test_lesson_runs(lesson: Path, tmp_path: Path, default_costmodel):
    text = lesson.read_text()
    cwd = sandbox(tmp_path / "tree")
    for command, expected in commands(text):
        code, got = run(command, cwd)
        assert matches(expected, got), (f"{lesson.name}: `{command}` printed (exit {code}):\n"
                                        + "\n".join(got))
    for figure in re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", text):
        assert any(figure in c for c, _ in commands(text)), f"{lesson.name}: no runnable command writes {figure}"
        made = cwd / "docs" / figure
        assert made.is_file() and (DOCS / figure).is_file(), f"{lesson.name}: {figure} missing"
        if figure.endswith(".png"):
            assert made.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_lesson_is_indexed_and_links_its_code():
    index = (DOCS / "README.md").read_text()
    for lesson in lessons():
        if lesson.name == "README.md":
            continue
        assert f"({lesson.name})" in index, f"docs/README.md does not link {lesson.name}"
        text = lesson.read_text()
        for link in re.findall(r"\]\((\.\./[^)#]+)", text):
            assert (DOCS / link).resolve().exists(), f"{lesson.name}: broken link {link}"
        assert re.search(r"^## Exercise", text, re.M), f"{lesson.name} has no exercise"


def _update() -> None:
    """Rewrite each command's output in place (blocks holding a '...' line are left alone)."""
    for lesson in lessons():
        text = lesson.read_text()

        def fill(match: re.Match) -> str:
            block = match.group(1)
            if any(line.strip() == "..." for line in block.splitlines()):
                return match.group(0)
            lines = []
            for command, _ in commands("```console runnable\n" + block + "```"):
                _, got = run(command, ROOT)          # for real: figures land in docs/figures
                lines += [f"$ {command}"] + got
            return "```console runnable\n" + "\n".join(lines) + "\n```"

        new = FENCE.sub(fill, text)
        if new != text:
            lesson.write_text(new)
            print(f"updated {lesson.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        sys.path.insert(0, str(ROOT))
        _update()
    else:
        print(__doc__)
