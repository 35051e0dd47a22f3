"""The README and the pages under docs/ stay true: every ```python block runs as written, every link resolves.

Each block runs in a fresh process of its own, with ``PYTHONPATH=src:examples`` (so that ``from seed_mlp import
SeedMLP`` works) and a temporary working directory (the logs and pictures the blocks write land there, not in the
repository). The processes are forked from one that has imported torch and lightning once: that import costs about
7 s on 2 cores, and paid per block it would make the test several times slower. Each child starts from an empty
``__main__``, so a block that forgets an import or uses a name it never defines fails as it would for a reader.

A block that cannot run here (it needs a GPU, or minutes) carries ``<!-- no-run: the reason -->`` on the line right
before its fence; a marker without a reason fails the test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_TIMEOUT_S = 90  # one block; the whole set takes about 35 s on 2 cores
NO_RUN = re.compile(r"<!--\s*no-run\b:?(.*?)-->")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`\s]*)")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # the fence's line, 1-based
    language: str
    code: str
    no_run: str | None  # None: it runs; else the marker's reason ("" when it gave none)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.groups()
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence[0] * len(fence)):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: a fence that is never closed"
        i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = NO_RUN.search(before)
        blocks.append(
            Snippet(page, start + 1, language, "\n".join(body) + "\n", marker.group(1).strip() if marker else None)
        )
    return blocks


SNIPPETS = [block for page in PAGES for block in fenced_blocks(page) if block.language == "python"]
RUNNABLE = [snippet for snippet in SNIPPETS if snippet.no_run is None]

# Run in a child of the test: imports torch and lightning once, then forks one process per block, in turn, each with
# its own output file and deadline. Prints one JSON line: each block's exit code (or "timeout") and seconds.
FORK_SERVER = r"""
import json, os, signal, sys, time, traceback
import torch, lightning, lightning_memtenants  # paid once; every block still imports what it uses

jobs = json.loads(sys.stdin.read())
results = []
for job in jobs:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(job["cwd"])
        sys.argv = [job["page"]]
        status = 0
        try:
            # padded so that a traceback's line numbers are the page's own
            code = compile("\n" * job["line"] + job["code"], job["page"], "exec")
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    deadline = start + job["timeout"]
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(wait_status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = "timeout"
            break
        time.sleep(0.02)
    results.append({"rc": rc, "seconds": round(time.monotonic() - start, 2)})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, float, str]]:
    base = tmp_path_factory.mktemp("snippets")
    jobs = []
    for k, snippet in enumerate(RUNNABLE):
        cwd = base / f"cwd{k}"
        cwd.mkdir()
        jobs.append(
            {
                "page": str(snippet.page.relative_to(ROOT)),
                "line": snippet.line,
                "code": snippet.code,
                "cwd": str(cwd),
                "out": str(base / f"out{k}.txt"),
                "timeout": SNIPPET_TIMEOUT_S,
            }
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples")])}
    done = subprocess.run(
        [sys.executable, "-c", FORK_SERVER],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        cwd=base,
        timeout=SNIPPET_TIMEOUT_S * len(jobs) + 120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        snippet.name: (result["rc"], result["seconds"], Path(job["out"]).read_text())
        for snippet, job, result in zip(RUNNABLE, jobs, results, strict=True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("snippet", RUNNABLE, ids=[snippet.name for snippet in RUNNABLE])
def test_python_block_runs_as_written(snippet: Snippet, snippet_runs: dict[str, tuple[object, float, str]]) -> None:
    rc, seconds, output = snippet_runs[snippet.name]
    assert rc == 0, f"{snippet.name} (exit {rc} after {seconds} s):\n{output[-6000:]}"


def test_every_page_has_python_blocks_and_every_skipped_one_says_why() -> None:
    pages = {snippet.page.name for snippet in SNIPPETS}
    assert "README.md" in pages
    assert len(RUNNABLE) >= 6
    for snippet in SNIPPETS:
        assert snippet.no_run != "", f"{snippet.name}: a no-run marker must give its reason"
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if NO_RUN.search(line):
                after = next((later for later in lines[number:] if later.strip()), "")
                assert after.startswith("```python"), f"{page.name}:{number}: no python fence follows"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code, where brackets are code, not links."""
    text = page.read_text()
    lines = text.splitlines()
    for block in fenced_blocks(page):
        for k in range(block.line - 1, block.line + block.code.count("\n") + 1):
            lines[k] = ""
    return INLINE_CODE.sub("", "\n".join(lines))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    in_fence = {block.line for block in fenced_blocks(page)}
    for number, line in enumerate(page.read_text().splitlines(), 1):
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading and number not in in_fence:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_points_to_a_file_of_the_repository(page: Path) -> None:
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: {target}: no heading with that anchor"


REPO_PATH = re.compile(r"`((?:src|tests|examples|benchmarks|scripts|docs)/[\w./-]*)`")
NAMED_FILE = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_-]*\.md)\b")  # README.md, FACTS.md: files by name


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_file_a_page_names_exists(page: Path) -> None:
    text = page.read_text()
    for path in REPO_PATH.findall(text):
        assert (ROOT / path).exists(), f"{page.name} names {path}, which is not in the repository"
    for name in NAMED_FILE.findall(text):
        assert (page.parent / name).exists() or (ROOT / name).exists(), f"{page.name} names {name}, which is not here"
    assert "shared/" not in text, f"{page.name} refers to a directory outside the repository"
