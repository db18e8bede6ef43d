"""The front door cannot rot: every Python example of README.md and docs/ runs, every relative
link of README.md, docs/ and CHANGELOG.md resolves, and the tables docs take from
benchmarks/results/ are that generated file's lines.

Conventions (docs/testing.md): a page's fenced ``python`` blocks run in order in one namespace, in
a folder where ``runs/multi30k-en-de`` is a tiny random model; a block that cannot run here says
why on the line above it (``<!-- not run: REASON -->``); a table copied from a results file sits
under ``<!-- from benchmarks/results/FILE -->``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CHANGELOG.md"]
CHECKPOINT = "runs/multi30k-en-de"  # the path the examples load

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->\s*\Z")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FROM = re.compile(r"^<!-- from (\S+) -->\n((?:\|.*\n?)+)", re.MULTILINE)
# The extras' packages: a page whose examples import one that is missing is skipped, as the
# extras' own tests are (CI installs them all).
EXTRAS = {"ctranslate2", "transformers", "fastapi", "uvicorn", "tensorboard"}
CI_COMMANDS = ("pip install torch==2.13.0", 'pip install -e ".[dev]"', "pytest tests -q")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, reason not run or None) of each fenced python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        line = text.count("\n", 0, match.start(2)) + 1
        reason = NOT_RUN.search(text[: match.start()])
        blocks.append((line, match.group(2), reason.group(1) if reason else None))
    return blocks


def prose(text: str) -> str:
    """``text`` without fenced blocks and code spans, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", prose(path.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
    return {f"{slug}-{n}" if n else slug for slug, count in seen.items() for n in range(count + 1)}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    tiny_checkpoint(folder / CHECKPOINT)
    return folder


RUNNABLE = [page for page in PAGES if any(r is None for _, _, r in python_blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(page, model_folder, tmp_path, monkeypatch):
    (tmp_path / "runs").symlink_to(model_folder / "runs", target_is_directory=True)
    monkeypatch.chdir(tmp_path)  # files the examples write stay in the test's folder
    namespace = {"__name__": "__docs__"}
    for line, code, reason in python_blocks(page):
        if reason is None:
            source = "\n" * (line - 1) + code  # tracebacks name the page's own lines
            try:
                exec(compile(source, str(page.relative_to(ROOT)), "exec"), namespace)
            except ModuleNotFoundError as error:
                if error.name not in EXTRAS:
                    raise
                pytest.skip(f"{error.name} is not installed (an extra)")


def test_the_examples_are_found_and_skips_give_reasons():
    blocks = {page.name: python_blocks(page) for page in PAGES}
    assert any(reason is None for _, _, reason in blocks["README.md"])
    skipped = [reason for page in blocks.values() for _, _, reason in page if reason is not None]
    assert all(reason.strip() for reason in skipped)
    assert len(skipped) <= sum(map(len, blocks.values())) // 3, "not run is for the few"


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_a_broken_link_and_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title, here\n\n[x](page.md#a-title-here) [y](#nowhere) [z](gone.md)\n")
    assert "a-title-here" in anchors(page)
    with pytest.raises(AssertionError, match=r"#nowhere.*gone\.md"):
        test_relative_links_resolve(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_from_results_are_the_generated_lines(page):
    for source, table in FROM.findall(page.read_text(encoding="utf-8")):
        generated = set((ROOT / source).read_text(encoding="utf-8").splitlines())
        rows = table.splitlines()
        assert len(rows) >= 3, f"{page.name}: an empty table under {source}"
        missing = [row for row in rows if row not in generated]
        assert not missing, f"{page.name}: not in {source}: {missing}"


def test_readme_is_a_front_door_with_ci_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = {line.strip() for line in text.splitlines()}
    for command in CI_COMMANDS:
        assert command in ci and command in lines, command
    assert not re.search(r"\b20\d\d-[01]\d-[0-3]\d\b", text), "no dates in README"
