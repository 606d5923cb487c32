"""mkdocs hook: the benchmark report in the site, and its headline table in the pages.

``make bench`` writes ``bench/results/latest.md``. The site publishes that report as it is
(``performance/report.md``, with its plot), and a page that holds the marker below gets the
report's headline table in its place: the rows of the Targets table that have a target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
REPORT = RESULTS / "latest.md"
MARKER = "<!-- bench-headline -->"


def headline(report: str) -> str:
    """The Targets table of ``report`` without its ``info`` rows, as markdown."""
    section = report.split("\n## Targets\n", 1)[1]
    table: list[str] = []
    for line in section.lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        table.append(line)
    header, rule, *rows = table
    kept = [row for row in rows if row.rstrip(" |").rsplit("|", 1)[-1].strip() != "info"]
    return "\n".join([header, rule, *kept])


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "performance/report.md", abs_src_path=str(REPORT)))
    files.append(
        File.generated(config, "performance/latest.png", abs_src_path=str(RESULTS / "latest.png"))
    )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, headline(REPORT.read_text()))
