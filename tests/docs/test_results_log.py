"""docs/results holds today's figures, docs/log the dated entries that measured them: nothing lost, nothing invented.

- every relative link of docs/results/*.md and docs/log/README.md resolves to a file of the repository;
- every figure in a docs/results table (a decimal such as 0.734 or +0.060, a percentage, a ratio such as 1.7x)
  appears in the docs/log entry (or entries) that its row or its table links to; a table with figures links at
  least one entry, in a row or in the text between the heading (or the table) before it and the table;
- every entry of docs/log is listed in docs/log/README.md, the notebook's table of contents;
- every results page stays under MAX_LINES lines (a page a user reads, not a notebook).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
LOG = ROOT / "docs" / "log"
LOG_INDEX = LOG / "README.md"
MAX_LINES = 300

LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}#{1,6}\s")
SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# A number not inside a longer one or a version (2.11.0): a decimal, or any number followed by % or x/×.
NUMBER = re.compile(r"(?<![\d.])[+\-\u2212]?(\d+(?:\.\d+)?)(?!\d|\.\d)(\s?%|[x\u00d7](?![\w]))?")


@dataclass
class Figure:
    text: str  # as the results page writes it, sign dropped: "0.734", "45%", "1.7x"
    kind: str  # "decimal", "percentage" or "ratio"
    value: str  # the digits: "0.734", "45", "1.7"

    def pattern(self) -> re.Pattern[str]:
        number = r"(?<![\d.])" + re.escape(self.value)
        if self.kind == "percentage":
            return re.compile(number + r"\s?%")
        if self.kind == "ratio":
            return re.compile(number + r"\s?[x\u00d7]")
        return re.compile(number + r"(?!\d)")


@dataclass
class Table:
    page: Path
    line: int  # first line, 1-based
    context_links: list[str]  # links between the heading (or table) before it and the table
    rows: list[tuple[int, str]] = field(default_factory=list)  # (line, text) of each row but the separator


def rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def links(text: str) -> list[str]:
    return [target for _, target in LINK.findall(text)]


def without_links(text: str) -> str:
    """The row's text with each link replaced by its text (link targets carry dates, not figures)."""
    return LINK.sub(lambda m: m.group(1), text)


def figures(text: str) -> list[Figure]:
    found = []
    for match in NUMBER.finditer(without_links(text)):
        value, suffix = match.group(1), (match.group(2) or "").strip()
        if suffix == "%":
            found.append(Figure(value + "%", "percentage", value))
        elif suffix:
            found.append(Figure(value + "x", "ratio", value))
        elif "." in value:
            found.append(Figure(value, "decimal", value))
    return found


def tables(page: Path) -> list[Table]:
    found: list[Table] = []
    context: list[str] = []
    current: Table | None = None
    fence = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        opening = FENCE.match(line)
        if fence:
            if opening and opening.group(1)[0] == fence[0]:
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        if line.lstrip().startswith("|"):
            if current is None:
                current = Table(page, number, list(context))
                found.append(current)
            if not SEPARATOR.match(line.strip()):
                current.rows.append((number, line))
            continue
        if current is not None:  # a table ended: the next table's context starts here
            current, context = None, []
        if HEADING.match(line):
            context = []
        context += links(line)
    return found


def resolve(page: Path, target: str) -> Path | None:
    """The file a relative link names; None for a URL or a link within the page."""
    if SCHEME.match(target) or target.startswith(("//", "#")):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    return ((ROOT if path.startswith("/") else page.parent) / path.lstrip("/")).resolve()


def log_entries(page: Path, targets: list[str], log_folder: Path) -> list[Path]:
    entries = []
    for target in targets:
        path = resolve(page, target)
        if path is not None and path.parent == log_folder.resolve() and path.suffix == ".md" \
                and path.name != "README.md" and path.is_file():
            entries.append(path)
    return entries


def figure_problems(page: Path, log_folder: Path = LOG) -> list[str]:
    """Every figure of every table of `page` against the log entries its row or table links."""
    problems = []
    for table in tables(page):
        table_entries = log_entries(page, table.context_links, log_folder)
        for line, row in table.rows:
            found = figures(row)
            if not found:
                continue
            entries = table_entries + log_entries(page, links(row), log_folder)
            where = f"{rel(page)}:{line}"
            if not entries:
                problems.append(
                    f"{where}: this table row cites {', '.join(f.text for f in found)} but neither the row nor the "
                    f"text above its table (line {table.line}) links a docs/log entry: link the dated entry that "
                    f"measured it, e.g. ([log](../log/YYYY-MM-DD_topic.md))")
                continue
            texts = {entry: entry.read_text(encoding="utf-8") for entry in entries}
            names = ", ".join(rel(entry) for entry in entries)
            for figure in found:
                if not any(figure.pattern().search(text) for text in texts.values()):
                    problems.append(
                        f"{where}: figure {figure.text} ({figure.kind}) is not in the log entry it links ({names}); "
                        f"row: {row.strip()[:160]}\n    copy the figure exactly as the entry states it, link the entry "
                        f"that measured it, or, for a new measurement, add a dated entry to docs/log/ first")
    return problems


def result_pages() -> list[Path]:
    return sorted(RESULTS.glob("*.md"))


def log_files() -> list[Path]:
    return sorted(p for p in LOG.glob("*.md") if p != LOG_INDEX)


def test_the_pages_exist():
    names = {p.name for p in result_pages()}
    wanted = {"README.md", "data.md", "model.md", "ops.md", "training.md", "deploy.md", "closed-loop.md",
              "benchmarks.md"}
    assert wanted <= names, (f"docs/results lacks {sorted(wanted - names)}: other pages link these names; write "
                             f"them (today's figures of that topic, each table linking its docs/log entry)")
    assert LOG_INDEX.is_file(), "docs/log/README.md is missing: write the notebook's dated table of contents"
    assert log_files(), "docs/log holds no entry: the figures in docs/results must link the entries that measured them"


@pytest.mark.parametrize("page", [*result_pages(), LOG_INDEX], ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for target in links(line):
            path = resolve(page, target)
            if path is not None and not path.exists():
                broken.append(f"{rel(page)}:{number}: ({target}) names {rel(path)}, which does not exist: fix the "
                              f"path (relative to {rel(page.parent)}/) or write that file")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", result_pages(), ids=rel)
def test_every_figure_is_in_the_log_entry_it_links(page):
    problems = figure_problems(page)
    assert not problems, (f"{len(problems)} figure(s) of {rel(page)} not found in their log entries (nothing lost, "
                          f"nothing invented):\n" + "\n".join(problems))


def test_every_log_entry_is_in_the_index():
    listed = {path for path in (resolve(LOG_INDEX, t) for t in links(LOG_INDEX.read_text(encoding="utf-8")))
              if path is not None}
    missing = [rel(p) for p in log_files() if p.resolve() not in listed]
    assert not missing, (f"docs/log/README.md does not list {missing}: add a line per entry (date, a link to the "
                         f"file, one sentence on what it measured)")


@pytest.mark.parametrize("page", result_pages(), ids=rel)
def test_results_page_stays_short(page):
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, (f"{rel(page)} has {lines} lines, {MAX_LINES} at most: keep today's figures only "
                               f"(fewer, clearer tables); superseded figures stay in their docs/log entries")


# The check itself must be able to fail.

def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_the_figure_check_catches_an_invented_figure_and_a_missing_link(tmp_path):
    log = tmp_path / "log"
    _write(log, "2026-11-28_x.md", "# X\n\nMoved verbatim.\n\n| a | b |\n|---|---|\n| DS | 0.734 [+0.010, +0.111], 1.39x, 45% |\n")
    page = _write(tmp_path / "results", "x.md", "\n".join([
        "# X", "", "Measured ([log](../log/2026-11-28_x.md)).", "",
        "| what | figure |", "|---|---|",
        "| right | 0.734, +0.010, 1.39×, 45 % |",
        "| invented | 0.735 |",
        "| invented ratio | 1.4x |",
        "| a version is no figure | torch 2.11.0, 704x256 |",
        "", "## Another", "", "| what | figure |", "|---|---|", "| unlinked | 0.734 |", ""]))
    problems = figure_problems(page, log)
    assert len(problems) == 3, "\n".join(problems)
    assert "figure 0.735 (decimal)" in problems[0] and "2026-11-28_x.md" in problems[0]
    assert "figure 1.4x (ratio)" in problems[1]
    assert "links a docs/log entry" in problems[2]


def test_figures_are_read_as_the_page_writes_them():
    assert [f.text for f in figures("| 0.734 / +0.060 [-0.011, +0.090] | 40.7 ms | 1.7× | 45% | 6 x 256x128 |")] == \
        ["0.734", "0.060", "0.011", "0.090", "40.7", "1.7x", "45%"]
    assert figures("| torch 2.11.0+cu130, valgrind 3.19.0, 2026-11-28, 34:48 |") == []
