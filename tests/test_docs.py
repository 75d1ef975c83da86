"""The documentation: README.md is the front door, docs/ the site that `mkdocs build --strict` makes
(CI's step after lint; it fails on a broken link or anchor between pages). What the build cannot see
is checked here, without MkDocs: the nav and the pages agree, README's links into docs/ reach a file
and a heading, and docs/flags.md is the flags' own help text."""

from __future__ import annotations

import dataclasses
import re
import unicodedata

import yaml
from helpers import REPO

from finetune.config.options import TrainConfig

DOCS = REPO / "docs"


def nav_pages(nav) -> list[str]:
    """The page files mkdocs.yml's nav names, in order (sections nest lists of {title: page})."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for entry in nav for page in nav_pages(entry)]


def test_every_docs_page_is_in_the_nav_once():
    pages = nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert len(pages) == len(set(pages)), pages
    assert sorted(pages) == sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))


def heading_anchor(heading: str) -> str:
    """The id MkDocs gives a heading (Python-Markdown's toc slugify of the heading's text)."""
    text = re.sub(r"[`*_]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: str) -> set[str]:
    text = re.sub(r"```.*?```", "", (REPO / page).read_text(), flags=re.S)
    return {heading_anchor(line.lstrip("#").strip()) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_readmes_links_reach_a_file_and_its_heading():
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text())
    into_docs = [link for link in links if link.startswith("docs/")]
    assert len(into_docs) >= 15, links  # the front door points into the site
    for link in links:
        assert not link.startswith(("http:", "https:", "/")), link  # relative, so a clone reads them
        path, _, anchor = link.partition("#")
        assert (REPO / path).exists(), link
        assert not anchor or anchor in anchors(path), link


def test_the_anchor_rule_is_mkdocs_own():
    assert heading_anchor("Mixture-of-experts models (and Gemma 3)") == "mixture-of-experts-models-and-gemma-3"
    assert heading_anchor("Run on SkyPilot / dstack") == "run-on-skypilot-dstack"
    assert "real-models-gguf" in anchors("docs/models.md")


def flag_row(field: dataclasses.Field) -> str:
    default = "—" if field.default is None else f"`{field.default}`"
    choices = field.metadata["choices"]
    text = field.metadata["help"] + (f" Choices: {', '.join(choices)}." if choices else "")
    return f"| `--{field.name.replace('_', '-')}` | {default} | {text} |"


def test_the_flags_page_is_the_flags_own_help():
    table = [line for line in (DOCS / "flags.md").read_text().splitlines() if line.startswith("| `--")]
    expected = [flag_row(field) for field in dataclasses.fields(TrainConfig)]
    assert table == expected, "docs/flags.md's rows, as finetune/config/options.py defines them:\n" + "\n".join(expected)
