"""The documentation holds together: every relative link and anchor resolves, every docs page is reachable from
README.md or docs/README.md, the flags reference is what scripts/flags_reference.py writes from TrainConfig, and the
README's short flags table agrees with it. No torch except for the flags checks (they import fsdp_lib.config)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading, a link there no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text (link targets and backticks gone), lowercased,
    punctuation dropped (letters, digits, '_', '-' and spaces kept), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link that is not to a web address: files of the repo and #anchors."""
    links = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                links.append((number, target))
    return links


def resolve(page: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    return ((page.parent / file_part).resolve() if file_part else page), anchor


def test_the_link_parser_sees_links_and_skips_code():
    page = DOCS / "flags.md"
    assert (page.parent.parent / "README.md").resolve() == resolve(page, "../README.md#install")[0]
    assert github_slug("Step 1: organize raw files (`organize_data.py`)") == "step-1-organize-raw-files-organize_datapy"
    assert github_slug("LoRA and QLoRA (`--peft`)") == "lora-and-qlora---peft"
    assert github_slug("Chat / instruction fine-tuning") == "chat--instruction-fine-tuning"
    assert LINK.findall(INLINE_CODE.sub("", "see [a](x.md#b), `[c](y.md)` and ![d](e.png)")) == ["x.md#b", "e.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for number, target in relative_links(page):
        path, anchor = resolve(page, target)
        if not path.exists():
            broken.append(f"line {number}: {target} (no {path.relative_to(REPO_ROOT)})")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"line {number}: {target} (no heading '#{anchor}' in {path.relative_to(REPO_ROOT)})")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_an_index():
    linked = set()
    for index in (REPO_ROOT / "README.md", DOCS / "README.md"):
        linked |= {resolve(index, target)[0] for _, target in relative_links(index)}
    orphans = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked and p.name != "README.md"]
    assert not orphans, f"docs pages no index links to (add them to docs/README.md): {orphans}"
    assert (DOCS / "README.md").resolve() in linked, "README.md must link to docs/README.md, the index"


def test_layout_page_has_a_row_for_every_module():
    layout = DOCS / "layout.md"
    linked = {resolve(layout, target)[0] for _, target in relative_links(layout)}
    modules = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "fsdp_lib").rglob("*.py"))
    missing = [str(m) for m in modules if (REPO_ROOT / m).resolve() not in linked]
    assert not missing, f"modules without a row in docs/layout.md (path and what its docstring says it owns): {missing}"


def load_flags_reference():
    spec = importlib.util.spec_from_file_location("flags_reference", REPO_ROOT / "scripts" / "flags_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_reference_is_generated_from_train_config():
    flags_reference = load_flags_reference()
    written = (DOCS / "flags.md").read_text()
    assert written == flags_reference.render(), "docs/flags.md is stale: run python scripts/flags_reference.py"
    assert "| `--seq-length` | `1024` |" in written and "| `-e, --experiment-name` | required |" in written


def test_readme_flags_table_agrees_with_train_config():
    """The README's 'Flags people change most' rows name real flags with their real defaults."""
    reference = {flag: default for flag, default, _ in load_flags_reference().flag_rows()}
    lines = prose_lines((REPO_ROOT / "README.md").read_text())
    after = lines[lines.index("### Flags people change most") + 1 :]
    first = next(i for i, line in enumerate(after) if line.startswith("|"))
    table = after[first : next((i for i in range(first, len(after)) if not after[i].startswith("|")), len(after))]
    rows = table[2:]  # after the header and the --- row
    assert len(rows) >= 10, "the README's short flags table is missing"
    wrong = []
    for row in rows:
        flag, default = (cell.strip() for cell in row.strip("|").split("|")[:2])
        if reference.get(flag) != default:
            wrong.append(f"{flag}: README says {default}, TrainConfig says {reference.get(flag, 'no such flag')}")
    assert not wrong, "README flags table drifted from TrainConfig:\n" + "\n".join(wrong)
