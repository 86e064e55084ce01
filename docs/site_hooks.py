"""mkdocs hooks (mkdocs.yml `hooks:`): the repository files the pages link outside docs/ go into the site too.

The pages are read in two places: in the repository, where `../CHANGELOG.md` or `../benchmarks/results/x.png` is
the file beside docs/, and in the built site, which holds docs/ alone, so those links would be dead there (and
`mkdocs build --strict` refuses them). Here each such file that exists is added to the site under `_repo/` (a
Markdown file becomes a page, an image is copied) and the page's link is rewritten to it, so the same link works
in both places and strict mode still refuses a link to a file that does not exist.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# ](../path) or ](../path#anchor): a relative link that climbs out of the page's folder
_LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")
_PREFIX = "_repo"


def _outside(page_uri: str, target: str) -> str | None:
    """The repository path of `target` linked from the page `page_uri` when it lies outside docs/, else None."""
    path = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    return path[3:] if path.startswith("../") and not path.startswith("../../") else None


def on_files(files, config):
    docs = Path(config["docs_dir"])
    root = docs.parent
    wanted = set()
    for f in list(files.documentation_pages()):
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        for target, _ in _LINK.findall(text):
            path = _outside(f.src_uri, target)
            if path is not None and (root / path).is_file():
                wanted.add(path)
    for path in sorted(wanted):
        files.append(File.generated(config, f"{_PREFIX}/{path}", abs_src_path=str(root / path)))
    return files


def on_page_markdown(markdown, page, config, files):
    def rewrite(m: re.Match) -> str:
        path = _outside(page.file.src_uri, m[1])
        if path is None or files.get_file_from_path(f"{_PREFIX}/{path}") is None:
            return m[0]   # left as written: strict mode reports it if it is broken
        new = posixpath.relpath(f"{_PREFIX}/{path}", posixpath.dirname(page.file.src_uri) or ".")
        return f"]({new}{m[2] or ''})"

    return _LINK.sub(rewrite, markdown)
