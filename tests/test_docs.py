"""The lessons in docs/ run as written: every shell block is executed and its output compared.

Convention (docs/README.md, "Conventions of these pages"): a fence opened with
``console`` (``console runnable`` is the older spelling of the same) is a shell
block. A line starting with ``$ `` is a command, run from the repository root
(a trailing ``\\`` continues it on the next line); the lines after it, up to the
next command, are its output (stdout and stderr together). A line ``...``
matches any number of lines, and ``...`` inside a line matches any part of it.
Trailing spaces are ignored.

A block that cannot run in the test suite (a benchmark, a long training run) is
opened as ``console slow``, with ``<!-- slow: REASON -->`` on the line right
above the fence; it runs only here:

    python tests/test_docs.py --slow [LESSON ...]   # the slow blocks (all lessons, or the named ones)
    python tests/test_docs.py --update              # rewrite outputs of fast blocks without '...'

Any other fence that holds shell commands (``bash``, ``sh``, a bare fence with
``$ `` lines or a bare ``mpirun``/``allreduce-run`` line) fails the test: a
command in a lesson is either run or marked. Bare ``mpirun`` commands fail as
root; lessons say ``allreduce-run``.

Commands run in a scratch copy of the tree (links to the real files, an empty
docs/figures), so the test never rewrites the committed figures.
``allreduce-explain`` and ``python`` scripts run in this process (no numba
start-up per command); anything else runs in a shell.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SLOW_NOTE = re.compile(r"<!--\s*slow:\s*\S.*?-->")
SHELL_INFO = {"bash", "sh", "shell", "zsh", "console"}
COMMAND_LINE = re.compile(r"^\s*(\$ |mpirun |allreduce-run |allreduce-explain |python |pip )")


def lessons() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


class Block:
    """One fenced block of a lesson: its info string, body, and the line it starts on."""

    def __init__(self, info: str, body: str, line: int, above: str):
        self.info, self.body, self.line, self.above = info.strip(), body, line, above

    @property
    def kind(self) -> str:
        """``fast`` / ``slow`` (shell blocks), ``unmarked`` (commands not run), or ``other``."""
        words = self.info.split()
        if words and words[0] == "console":
            return "slow" if "slow" in words[1:] else "fast"
        if (words and words[0] in SHELL_INFO) or (not words or words[0] in ("text", "")) and any(
                COMMAND_LINE.match(line) for line in self.body.splitlines()):
            return "unmarked"
        return "other"


def blocks(text: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        out.append(Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, before[-1] if before else ""))
    return out


def commands(body: str) -> list[tuple[str, list[str]]]:
    """``[(command, expected output lines)]`` of one shell block."""
    out: list[tuple[str, list[str]]] = []
    continued = False
    for line in body.splitlines():
        if continued:
            out[-1] = (out[-1][0][:-1].rstrip() + " " + line.strip(), [])
        elif line.startswith("$ "):
            out.append((line[2:].rstrip(), []))
        elif out:
            out[-1][1].append(line.rstrip())
        continued = bool(out) and not out[-1][1] and out[-1][0].endswith("\\")
    return out


def _line_matches(want: str, got: str) -> bool:
    if want == got:
        return True
    if "..." not in want:
        return False
    return re.fullmatch(".*".join(re.escape(part) for part in want.split("...")), got) is not None


def matches(expected: list[str], got: list[str]) -> bool:
    """Line by line; ``...`` alone matches any run of lines (including none), inside a line any part."""
    memo: dict[tuple[int, int], bool] = {}

    def go(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(expected):
                memo[i, j] = j == len(got)
            elif expected[i] == "...":
                memo[i, j] = any(go(i + 1, k) for k in range(j, len(got) + 1))
            else:
                memo[i, j] = j < len(got) and _line_matches(expected[i], got[j]) and go(i + 1, j + 1)
        return memo[i, j]
    return go(0, 0)


def _in_process(argv: list[str]) -> bool:
    return argv[0] == "allreduce-explain" or (argv[0] == "python" and len(argv) > 1 and
                                             (argv[1].endswith(".py") or argv[1:3] == ["-m", "allreduce.explain"]))


def run(command: str, cwd: Path, timeout: float = 120) -> tuple[int, list[str]]:
    """Run one documented command; ``(exit code, output lines)``."""
    argv = shlex.split(command)
    if not _in_process(argv) or any(c in command for c in "|><;&$") or "=" in argv[0]:
        env = dict(os.environ, PYTHONPATH=str(cwd) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(command, shell=True, cwd=cwd, env=env, text=True, errors="replace",
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        return proc.returncode, [line.rstrip() for line in proc.stdout.splitlines()]
    buf, old_cwd, old_argv, code = io.StringIO(), os.getcwd(), sys.argv, 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                if argv[0] == "allreduce-explain" or argv[1] == "-m":
                    if argv[0] == "python" and argv[2] != "allreduce.explain":
                        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                    else:
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
    for script in (DOCS / "figures").glob("*.py"):          # the figure script, without its figures
        (tmp / "docs" / "figures" / script.name).symlink_to(script)
    return tmp


def _tree_state() -> str:
    """What git sees changed in the checkout, contents included ('' outside a git checkout)."""
    try:
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60).stdout
        diff = subprocess.run(["git", "diff"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return status + hashlib.sha256(diff.encode()).hexdigest()


def check_block(lesson: Path, block: Block, cwd: Path, timeout: float = 120) -> None:
    """Run every command of one shell block; raise AssertionError naming the first that differs,
    or the first that wrote into the checkout (a lesson writes to a scratch path: issue 34)."""
    for command, expected in commands(block.body):
        before = _tree_state()
        code, got = run(command, cwd, timeout)
        after = _tree_state()
        assert after == before, (f"{lesson.name}:{block.line}: `{command}` changed the checkout (git status "
                                 f"before:\n{before.rsplit(chr(10), 1)[0]}\nafter:\n{after.rsplit(chr(10), 1)[0]})")
        assert not any("\x00" in line for line in got), f"{lesson.name}:{block.line}: `{command}` printed a NUL byte"
        assert matches(expected, got), (f"{lesson.name}:{block.line}: `{command}` printed (exit {code}):\n"
                                        + "\n".join(got))


def test_a_block_that_writes_into_the_checkout_fails(tmp_path):
    """The guard itself: a command that leaves a file in the checkout fails, naming it."""
    if not _tree_state():
        pytest.skip("not a git checkout")
    stray = ROOT / "test_docs_guard.tmp"
    try:
        with pytest.raises(AssertionError, match="changed the checkout(?s:.*)test_docs_guard.tmp"):
            check_block(Path("guard.md"), Block("console", f"$ touch {stray}\n", 1, ""), sandbox(tmp_path / "tree"))
    finally:
        stray.unlink(missing_ok=True)


@pytest.fixture
def default_costmodel(tmp_path, monkeypatch):
    """The printed cost-model numbers use select.py's DEFAULTS, not constants fitted on this machine."""
    from allreduce.algorithms import select
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ALLREDUCE_COSTMODEL", raising=False)
    select.clear_cache()
    yield
    select.clear_cache()


def _figures_made_by_script() -> set[str]:
    """The figures docs/figures/make.py draws (its FIGURES), as lessons link them."""
    return {f"figures/{name}" for name in runpy.run_path(str(DOCS / "figures" / "make.py"), run_name="figures")["FIGURES"]}


@pytest.mark.parametrize("lesson", lessons(), ids=lambda p: p.name)
def test_lesson_runs(lesson: Path, tmp_path: Path, default_costmodel):
    text = lesson.read_text()
    cwd = sandbox(tmp_path / "tree")
    for block in blocks(text):
        if block.kind == "fast":
            check_block(lesson, block, cwd)
    for figure in re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", text):
        assert (DOCS / figure).is_file(), f"{lesson.name}: {figure} is not checked in"
        assert figure in _figures_made_by_script(), \
            f"{lesson.name}: {figure} is not drawn by docs/figures/make.py"


@pytest.mark.parametrize("lesson", lessons(), ids=lambda p: p.name)
def test_every_command_is_run_or_marked_slow(lesson: Path):
    """A shell command in a lesson is either in a run block or in a ``console slow`` block with its reason."""
    for block in blocks(lesson.read_text()):
        where = f"{lesson.name}:{block.line}"
        assert block.kind != "unmarked", (f"{where}: a ```{block.info} block with commands is neither run nor "
                                          "marked: open it as ```console (or ```console slow with "
                                          "<!-- slow: REASON --> right above)")
        if block.kind == "slow":
            assert SLOW_NOTE.search(block.above), f"{where}: a ```console slow block needs <!-- slow: REASON --> right above it"
        if block.kind in ("fast", "slow"):
            for command, _ in commands(block.body):
                assert not re.match(r"(\S+=\S+ )*mpirun\b", command), \
                    f"{where}: `{command}`: bare mpirun fails as root; use allreduce-run"
                assert "docs/figures/" not in command or "docs/figures/make.py" in command, \
                    f"{where}: `{command}` writes over a checked-in figure; write to a scratch path (/tmp/...)"


def test_every_lesson_is_indexed_and_links_its_code():
    index = (DOCS / "README.md").read_text()
    for lesson in lessons():
        if lesson.name == "README.md":
            continue
        assert f"({lesson.name})" in index, f"docs/README.md does not link {lesson.name}"
        text = lesson.read_text()
        for link in re.findall(r"\]\((\.\./[^)#]+)", text):
            assert (DOCS / link).resolve().exists(), f"{lesson.name}: broken link {link}"
        if not re.match(r"\d\d-", lesson.name):       # notes.md and the like: pages, not lessons
            continue
        assert re.search(r"^## Exercise", text, re.M), f"{lesson.name} has no exercise"
        exercise = text[re.search(r"^## Exercise", text, re.M).start():]
        assert any(b.kind in ("fast", "slow") for b in blocks(exercise)), \
            f"{lesson.name}: the exercise has no command that checks the answer"


def test_matching():
    assert matches(["a", "...", "c"], ["a", "b", "b", "c"]) and matches(["..."], [])
    assert matches(["time ... us"], ["time 12.5 us"]) and not matches(["time ... us"], ["time 12.5 ms"])
    assert not matches(["a"], ["a", "b"]) and not matches(["a", "..."], ["b"])
    assert commands("$ a \\\n  b\nout\n$ c\n") == [("a b", ["out"]), ("c", [])]
    assert Block("bash", "$ ls\n", 1, "").kind == "unmarked" and Block("", "mpirun -np 2 x\n", 1, "").kind == "unmarked"
    assert Block("", "a diagram\n", 1, "").kind == "other" and Block("console slow", "", 1, "").kind == "slow"


def _run_slow(names: list[str]) -> int:
    """Run the ``console slow`` blocks (of the named lessons, or all); print each verdict; 1 if any failed."""
    chosen = [p for p in lessons() if not names or p.name in names or p.stem in names]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        cwd = sandbox(Path(tmp) / "tree")
        for lesson in chosen:
            for block in blocks(lesson.read_text()):
                if block.kind != "slow":
                    continue
                start = time.monotonic()
                try:
                    check_block(lesson, block, cwd, timeout=900)
                    verdict = "ok"
                except Exception as exc:                   # a failed assertion, a timeout, a missing file
                    failed, verdict = failed + 1, f"FAILED\n{exc}"
                print(f"{lesson.name}:{block.line}: {time.monotonic() - start:.0f} s {verdict}", flush=True)
    return 1 if failed else 0


def _update() -> None:
    """Rewrite each command's output in place (fast blocks only; blocks holding '...' are left alone)."""
    for lesson in lessons():
        text = lesson.read_text()

        def fill(match: re.Match) -> str:
            info, body = match.group(1), match.group(2)
            block = Block(info, body, 0, "")
            if block.kind != "fast" or "..." in body:
                return match.group(0)
            lines = []
            for command, _ in commands(body):
                with tempfile.TemporaryDirectory() as tmp:
                    _, got = run(command, sandbox(Path(tmp) / "tree"))
                lines += [f"$ {command}"] + got
            return f"```{info}\n" + "\n".join(lines) + "\n```"

        new = FENCE.sub(fill, text)
        if new != text:
            lesson.write_text(new)
            print(f"updated {lesson.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:2] == ["--update"]:
        _update()
    elif sys.argv[1:2] == ["--slow"]:
        sys.exit(_run_slow(sys.argv[2:]))
    else:
        print(__doc__)
