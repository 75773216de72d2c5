"""Every result file the docs cite is in the repository: a figure never loses the file that backs it
when results/ is reorganised."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# a results path as the docs write it; templates ({seed}, <device>) and a command's own output (after --out,
# where several seeds add -seedN) name files a command will write
CITED = re.compile(r"(--out |--plot |--checkpoint )?(?<![\w/.-])(results/[A-Za-z0-9_.*/{}<>-]+)")


def cited_paths(page: Path) -> list[str]:
    found = (m.group(2).rstrip(".,:;)`'\"") for m in CITED.finditer(page.read_text()) if not m.group(1))
    return sorted({p for p in found if not any(c in p for c in "{}<>")})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_path_a_page_cites_exists(page):
    assert page.exists(), f"{page} is missing"
    missing = [p for p in cited_paths(page)  # a link to a page under docs/results/ is relative to the page
               if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists() or (page.parent / p).exists())]
    assert not missing, f"{page.relative_to(ROOT)} cites results that are not there: {missing}"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_the_pages_lands_on_a_heading(page):
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?(?:#([^)\s]+))?\)", page.read_text()):
        linked = (page.parent / target).resolve() if target else page
        if not linked.exists() or (anchor and anchor not in anchors(linked)):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{page.relative_to(ROOT)} links to headings that are not there: {broken}"
