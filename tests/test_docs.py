"""Every page of docs/ is linked from README, and every relative link and image in README and docs/ points at a
file that exists (and, with a #fragment, at a heading of that file)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(!?)\[[^\]\n]*\]\(([^)\s]+)\)")
IMG_TAG = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]+)\"")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)


def prose(text):
    """The text outside code: fenced blocks and inline code spans removed (a link inside them is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text):
    """GitHub's ids for the headings of a markdown text: lower case, punctuation dropped, spaces to hyphens, a
    repeated id numbered -1, -2, ..."""
    seen, ids = {}, set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def broken_links(page, text):
    """['target (why)'] for every relative link or image of `text` (the content of `page`) that points nowhere:
    a missing file, an image that is not a file, or a #fragment that names no heading of its file."""
    found = [(bang == "!", target) for bang, target in LINK.findall(prose(text))]
    found += [(True, target) for target in IMG_TAG.findall(prose(text))]
    broken = []
    for image, target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (image and not file.is_file()):
            broken.append(f"{target} (no such {'image' if image else 'file'})")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target} (no heading #{fragment})")
    return broken


def test_the_checker_catches_a_missing_file_image_and_heading_and_skips_code(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d/there.md").write_text("# Here it is\n\n## The paper's runs\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "d/pic.png").write_bytes(b"\x89PNG")
    page = tmp_path / "page"  # only its folder matters: the links are read from `text`
    text = ("[ok](d/there.md#here-it-is) [ok](d/there.md#the-papers-runs) ![ok](d/pic.png) [web](https://x.org/a.md)\n"
            "[gone](d/missing.md) ![gone](d/nope.png) [no heading](d/there.md#not-a-heading) <img src=\"d/lost.png\">\n"
            "![a folder](d) `[in code](d/missing.md)`\n```\n[in a block](d/missing.md)\n```\n")
    assert broken_links(page, text) == ["d/missing.md (no such file)", "d/nope.png (no such image)",
                                        "d/there.md#not-a-heading (no heading #not-a-heading)",
                                        "d (no such image)", "d/lost.png (no such image)"]


def test_every_relative_link_and_image_in_readme_and_docs_exists():
    assert len(PAGES) > 1, "docs/ holds no pages"
    broken = [f"{page.relative_to(ROOT)}: {problem}"
              for page in PAGES for problem in broken_links(page, page.read_text())]
    assert not broken, f"links or images that point nowhere: {broken}"


def test_readme_links_every_page_of_docs():
    text = README.read_text()
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in LINK.findall(prose(text))}
    unlinked = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not unlinked, f"docs/ pages README does not link: {unlinked}"
