"""docs/TOUR.md cannot drift from the code: every ```python snippet of the tour runs as a reader runs it (`python -`
from the repository's root, in a process of its own) and prints exactly the ```text block shown under it; every stop
names the code to read and links a figure and a RESULTS.md section that exist."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

TOUR = ROOT / "docs" / "TOUR.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def stops() -> list[tuple[str, str]]:
    """The tour's stops: (title, body) per `## ` heading."""
    parts = re.split(r"^## ", TOUR.read_text(), flags=re.M)[1:]
    return [(p.split("\n", 1)[0], p.split("\n", 1)[1]) for p in parts]


def snippets() -> list[tuple[str, str, str]]:
    """(stop title, snippet, what the tour says it prints): each ```python block and the ```text block after it."""
    out = []
    for title, body in stops():
        blocks = FENCE.findall(body)
        for i, (lang, code) in enumerate(blocks):
            if lang == "python":
                assert i + 1 < len(blocks) and blocks[i + 1][0] == "text", f"{title}: a snippet without its output"
                out.append((title, code, blocks[i + 1][1]))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_tour_has_seven_stops_each_with_code_to_read_a_snippet_a_figure_and_results():
    anchors = {slug(line.lstrip("#")) for line in (ROOT / "RESULTS.md").read_text().splitlines()
               if line.startswith("#")}
    titles = [t for t, _ in stops()]
    assert len(titles) == 7 and len(snippets()) == 7, titles
    for title, body in stops():
        read = body.split("**Read:**", 1)[1].split("\n\n", 1)[0]  # the code to read: files and their functions
        names = re.findall(r"`([\w.]+)`", read)
        assert read.lstrip().startswith("`") and names[0].endswith(".py"), title
        assert any(not name.endswith(".py") for name in names), title
        links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", body)
        figures = [path for path, _ in links if path.startswith("figures/")]
        results = [anchor for path, anchor in links if path == "../RESULTS.md"]
        assert "**Figure:**" in body and results, title  # every stop but the first belongs to a paper's figure
        assert figures or title.startswith("1. "), title
        for path in figures:
            assert (TOUR.parent / path).is_file(), (title, path)
        for anchor in results:
            assert anchor in anchors, (title, anchor)


@pytest.mark.slow
@pytest.mark.parametrize("n", range(7))
def test_each_snippet_prints_what_the_tour_shows(n):
    title, code, shown = snippets()[n]
    env = dict(os.environ, PYTHONPATH="")
    run = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert run.returncode == 0, f"{title}:\n{run.stderr}"
    printed = [line.rstrip() for line in run.stdout.rstrip().splitlines()]
    assert printed == [line.rstrip() for line in shown.rstrip().splitlines()], title
