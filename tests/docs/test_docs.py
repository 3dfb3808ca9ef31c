"""The pages a newcomer reads hold what they promise: README.md and docs/**/*.md.

- every relative link resolves, and every `#anchor` names a heading of the markdown file it points into (GitHub's
  slugs);
- every example marked runnable runs: a fenced block whose info string is `bash runnable` or `python runnable`
  (Polygraphy's tests/test_examples.py pattern). Bash runs under `bash -euo pipefail` in the repository root with
  the venv's bin first on PATH; Python under this interpreter. Mark only cheap examples that change nothing;
- every page at the top of docs/ is listed in docs/README.md, README.md links docs/README.md, and each page says
  at its top what it covers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
INDEX = DOCS / "README.md"
README_MAX_LINES = 200
"""README.md serves a newcomer: the commands, the tour, the tables. Reference text goes to a page under docs/."""
EXAMPLE_TIMEOUT_S = 120
RUNNABLE = "runnable"
LANGUAGES = ("bash", "python")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*$")
"""`[label]: target "title"` on a line of its own; it cannot interrupt a paragraph (`[0.1, 0.2]: more` is text)."""
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=[\"']([^\"']+)[\"']", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))] if DOCS.is_dir() else [README]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    info: str
    code: str


@dataclass
class Page:
    path: Path
    links: list[tuple[int, str]]  # (line, target) outside code
    headings: list[str]
    anchors: set[str]
    blocks: list[Block]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def parse(path: Path) -> Page:
    lines = path.read_text(encoding="utf-8").splitlines()
    links: list[tuple[int, str]] = []
    headings: list[str] = []
    blocks: list[Block] = []
    anchors: set[str] = set()
    fence, info, start, body = None, "", 0, []
    previous = ""  # the previous line outside code, for setext headings
    for number, line in enumerate(lines, 1):
        if fence:
            closing = FENCE.match(line)
            if closing and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence) \
                    and not closing.group(2).strip():
                blocks.append(Block(path, start, info, "\n".join(body) + "\n"))
                fence, previous = None, ""
            else:
                body.append(line)
            continue
        opening = FENCE.match(line)
        if opening and not (opening.group(1)[0] == "`" and "`" in opening.group(2)):
            fence, info, start, body = opening.group(1), opening.group(2).strip(), number, []
            previous = ""
            continue
        atx = ATX.match(line)
        if atx:
            headings.append(atx.group(2) or "")
        elif SETEXT.match(line) and previous.strip() and not ATX.match(previous) \
                and not previous.lstrip().startswith(("|", "-", "*", ">")):
            headings.append(previous.strip())
        text = CODE_SPAN.sub("", line)
        links += [(number, target) for target in INLINE_LINK.findall(text)]
        definition = REFERENCE_DEFINITION.match(text)
        if definition and (not previous.strip() or REFERENCE_DEFINITION.match(CODE_SPAN.sub("", previous))):
            links.append((number, definition.group(1)))
        anchors.update(HTML_ANCHOR.findall(text))
        previous = line
    if fence:
        pytest.fail(f"{rel(path)}:{start}: a code fence opened here is never closed; close it with {fence}")
    seen: dict[str, int] = {}
    for heading in headings:
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if not count else f"{base}-{count}")
    return Page(path, links, headings, anchors, blocks)


PARSED: dict[Path, Page] = {}


def parsed(path: Path) -> Page:
    if path not in PARSED:
        PARSED[path] = parse(path)
    return PARSED[path]


def resolve(page: Path, target: str) -> tuple[Path | None, str]:
    """(the file or folder a relative link names, its anchor); (None, "") for a URL with a scheme."""
    if SCHEME.match(target) or target.startswith("//"):
        return None, ""
    path_part, _, anchor = target.partition("#")
    path_part = path_part.split("?", 1)[0]
    if not path_part:
        return page, anchor
    base = ROOT if path_part.startswith("/") else page.parent
    return (base / path_part.lstrip("/")).resolve(), anchor


def link_problems(page: Path) -> list[str]:
    found = []
    for line, target in parsed(page).links:
        where = f"{rel(page)}:{line}: link ({target})"
        if not target:
            found.append(f"{where} is empty: give the page or #heading it means")
            continue
        path, anchor = resolve(page, target)
        if path is None:
            continue
        if ROOT not in path.parents and path != ROOT:
            found.append(f"{where} leaves the repository ({path}): link a file of the repository or a full URL")
            continue
        if not path.exists():
            found.append(f"{where} names {rel(path)}, which does not exist: fix the path (relative to "
                         f"{rel(page.parent) or '.'}/) or write that page")
            continue
        if anchor and path.is_file() and path.suffix == ".md":
            target_page = parsed(path)
            if anchor not in target_page.anchors:
                near = sorted(target_page.anchors, key=lambda a: _distance(a, anchor))[:3]
                found.append(f"{where}: no heading of {rel(path)} has the anchor #{anchor} (GitHub's slug: lower "
                             f"case, punctuation dropped, spaces as hyphens); nearest: "
                             + ", ".join(f"#{a}" for a in near))
    return found


def _distance(a: str, b: str) -> int:
    """Edit distance, for the nearest anchors in a message."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def examples() -> list[Block]:
    found = []
    for page in pages():
        for block in parsed(page).blocks:
            words = block.info.split()
            if RUNNABLE in words[1:] and words[0] in LANGUAGES:
                found.append(block)
    return found


def example_id(block: Block) -> str:
    return f"{rel(block.page)}:{block.line}"


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_links_resolve(page):
    problems = link_problems(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def _tree_names() -> set[str]:
    """What an example could leave behind: the names at the top of the repository and of runs/."""
    names = {p.name for p in ROOT.iterdir()}
    runs = ROOT / "runs"
    return names | ({f"runs/{p.name}" for p in runs.iterdir()} if runs.is_dir() else set())


@pytest.mark.parametrize("block", examples(), ids=example_id)
def test_runnable_example(block):
    language = block.info.split()[0]
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    command = (["bash", "-euo", "pipefail", "-c", block.code] if language == "bash"
               else [sys.executable, "-c", block.code])
    before = _tree_names()
    where = f"{example_id(block)} ({language} runnable)"
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=EXAMPLE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where} ran past {EXAMPLE_TIMEOUT_S} s: examples marked runnable must be cheap; make it "
                    f"faster or drop `{RUNNABLE}` from its info string\n{block.code}")
    left = sorted(_tree_names() - before)
    assert result.returncode == 0, (
        f"{where} exited {result.returncode}: fix the example or the code it shows (the docs promise it works "
        f"as written)\n--- example ---\n{block.code}--- stdout (tail) ---\n{result.stdout[-3000:]}"
        f"\n--- stderr (tail) ---\n{result.stderr[-3000:]}")
    assert not left, (f"{where} left {left} behind: a runnable example must change nothing; write into a "
                      f"temporary folder and remove it, or drop `{RUNNABLE}`")


def test_there_are_runnable_examples():
    """The parser still finds the examples (a changed info string would silently run none)."""
    assert len(examples()) >= 6, (f"only {len(examples())} examples marked runnable in README.md and docs/: mark "
                                  f"cheap examples with ```bash {RUNNABLE} or ```python {RUNNABLE}")


def _links_to(page: Path, wanted: Path) -> bool:
    for _, target in parsed(page).links:
        path, _ = resolve(page, target)
        if path is not None and (path == wanted or (wanted.name == "README.md" and path == wanted.parent)):
            return True
    return False


def test_readme_links_the_docs_index():
    assert INDEX.is_file(), f"{rel(INDEX)} is missing: write the index of the pages under docs/"
    assert _links_to(README, INDEX), f"README.md does not link {rel(INDEX)}: add a link to the index of the docs"


def test_every_docs_page_is_in_the_index():
    assert INDEX.is_file(), f"{rel(INDEX)} is missing: write the index of the pages under docs/"
    missing = [rel(p) for p in sorted(DOCS.glob("*.md")) if p != INDEX and not _links_to(INDEX, p)]
    assert not missing, f"{rel(INDEX)} does not list {missing}: add a line linking each page, saying what it covers"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")) if DOCS.is_dir() else [], ids=rel)
def test_page_says_what_it_covers(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines and lines[0].startswith("# "), f"{rel(page)}: the first line must be its title (`# ...`)"
    first = next((line for line in lines[1:] if line.strip()), "")
    assert first and not first.startswith(("#", "```", "|", "-", "*", "<")), (
        f"{rel(page)}: under the title, say in a sentence or two what the page covers (found {first!r})")


def test_readme_stays_short_and_names_the_test_command():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move reference text to its page under docs/ "
        f"and link it")
    commands = [block.code for block in parsed(README).blocks]
    assert any(re.search(r"^make test\b", code, re.MULTILINE) for code in commands), (
        "README.md names no `make test` in a code block: CI (.ci/run) runs exactly the test command README names")
