"""One self-contained HTML page: figures inline as base64 PNG data URIs, tables of their numbers.

The page loads nothing: no script, no stylesheet, no font, no URL (BertViz's saved pages fetch
their scripts from a CDN and stay blank offline: bertviz issues #41, #63). Every figure is also
saved beside the page as PNG and SVG, and listed by file name (as text, not links). Every text is
HTML-escaped. The pictures wait in a hidden staging folder inside ``out_dir`` until the page is
written, and the page is written under a temporary name and renamed into place: a reader never
finds half a page, and a report that fails halfway leaves the folder's last report (its page and
pictures) as it was.
"""

from __future__ import annotations

import base64
import html
import numbers
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from torchvote.explain.figures import close_figure, save_figure
from torchvote.files import atomic_write, make_folder
from torchvote.validation import as_path

__all__ = ["STAGING_PREFIX", "HtmlReport"]

#: The name of the hidden folder inside ``out_dir`` where a report's pictures wait for its page
#: (one left by a killed run is no user's file).
STAGING_PREFIX = ".torchvote-report-staging-"

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 70rem; margin: 2rem auto;
       padding: 0 1rem; color: #1d1d1f; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; border-bottom: 1px solid #ddd; padding-top: 1rem; }
h3 { font-size: 1.05rem; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.9rem; color: #444; }
.files { font-family: monospace; font-size: 0.8rem; color: #666; }
table { border-collapse: collapse; margin: 0.6rem 0 1.2rem; font-size: 0.85rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: left; } th { background: #f3f3f3; }
.notice { background: #fff4d6; border-left: 4px solid #e0a800; padding: 0.4rem 0.8rem; }
nav a { margin-right: 0.8rem; }
"""


@dataclass
class HtmlReport:
    """Collects headings, text, figures and tables, then writes ``index.html`` and the image files.

    Args:
        title: page title.
        out_dir: folder for the page and the PNG/SVG files (created with the report; the
            pictures are staged in a hidden folder inside it until :meth:`write`).

    Attributes:
        files: the image files of the figures added so far, where :meth:`write` puts them.

    Raises:
        TypeError: ``title`` not a string, or ``out_dir`` neither a ``str`` nor an
            ``os.PathLike`` (``''`` is a ValueError).

    Example::

        report = HtmlReport("Attention", out_dir)
        report.figure(fig, "layer0", caption="...", table=(["token", "weight"], rows))
        path = report.write()
    """

    title: str
    out_dir: Path
    # the page being built: filled by the methods below, never passed to the constructor
    _parts: list[str] = field(init=False, repr=False, default_factory=list)
    _sections: list[tuple[str, str]] = field(init=False, repr=False, default_factory=list)
    files: list[Path] = field(init=False, default_factory=list)  # the image files saved so far
    _names: set[str] = field(init=False, repr=False, default_factory=set)  # figure stems used
    _staging: Path | None = field(init=False, repr=False, default=None)  # pictures awaiting write()

    def __post_init__(self) -> None:
        if not isinstance(self.title, str):  # failed only in render(), after every figure was drawn
            raise TypeError(f"title must be a string, got {type(self.title).__name__}")
        self.out_dir = as_path(self.out_dir, "out_dir")
        make_folder(self.out_dir)

    def heading(self, text: str, *, level: int = 2) -> None:
        """Add a heading (escaped); level-2 headings are listed in the page's table of contents.

        Args:
            text: the heading (any object is shown as its ``str``).
            level: 2 (a section) or 3.

        Raises:
            ValueError: another ``level``.
        """
        if level not in (2, 3):
            raise ValueError(f"level must be 2 or 3, got {level!r}")
        text = str(text)
        anchor = ""
        if level == 2:
            anchor = f"s{len(self._sections)}"
            self._sections.append((anchor, text))
        self._parts.append(f"<h{level}{f' id={anchor!r}' if anchor else ''}>{html.escape(text)}</h{level}>")

    def text(self, text: str, *, notice: bool = False) -> None:
        """Add a paragraph (escaped); ``notice`` highlights it (truncation, missing inputs).

        Args:
            text: the paragraph (any object is shown as its ``str``).
            notice: highlight it.
        """
        css = ' class="notice"' if notice else ""
        self._parts.append(f"<p{css}>{html.escape(str(text))}</p>")

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]], *, caption: str = "") -> None:
        """Add a table (escaped); real numbers that are not integers (Python, NumPy or 0-d tensor)
        are shown with 4 significant digits.

        Args:
            headers: the column names.
            rows: the rows, each with one cell per header.
            caption: text above the table.

        Raises:
            ValueError: a row whose length differs from ``headers``.
        """
        caption = "" if caption is None else str(caption)  # any object, as heading() and text()
        cells = []
        for index, row in enumerate(rows):
            if len(row) != len(headers):
                raise ValueError(f"rows[{index}] has {len(row)} cells, headers has {len(headers)}")
            cells.append("<tr>" + "".join(f"<td>{html.escape(_fmt(value))}</td>" for value in row) + "</tr>")
        head = "<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in headers) + "</tr>"
        cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
        self._parts.append(f"<table>{cap}<thead>{head}</thead><tbody>{''.join(cells)}</tbody></table>")

    def figure(
        self,
        figure,
        name: str,
        *,
        caption: str = "",
        table: tuple[Sequence[str], Sequence[Sequence[object]]] | None = None,
    ) -> list[Path]:
        """Save ``figure`` as ``name.png`` / ``name.svg`` for beside the page and inline the PNG.

        The files are staged: :meth:`write` moves them beside the page, :meth:`discard` drops them.

        Args:
            figure: a matplotlib Figure (closed afterwards, also when it is refused).
            name: file stem, letters, digits, ``-`` and ``_`` only, not used before in this
                report (a second figure of that name would overwrite the first one's files).
            caption: text under the picture (any object is shown as its ``str``; ``None``: none).
            table: optional ``(headers, rows)``: the numbers behind the picture.

        Returns:
            The files' paths beside the page (there once :meth:`write` has run).

        Raises:
            ValueError: a ``name`` with other characters (ASCII ones only: :meth:`write` finds
                the pictures of the page it replaces by these names), or one already used; a
                ``table`` that is not a ``(headers, rows)`` pair. Checked before anything is
                saved.
        """
        caption = "" if caption is None else str(caption)
        problem = None
        if not isinstance(name, str) or not name or not all(
            ch.isascii() and (ch.isalnum() or ch in "-_") for ch in name
        ):
            problem = f"name must be ASCII letters, digits, '-' and '_', got {name!r}"
        elif name in self._names:
            problem = f"name {name!r} is already a figure of this report: its files would be replaced"
        elif table is not None and (isinstance(table, (str, bytes)) or not isinstance(table, Sequence)
                                    or len(table) != 2):
            problem = f"table must be a (headers, rows) pair, got {table!r}"
        if problem is not None:  # before the picture is saved and its name taken
            close_figure(figure)
            raise ValueError(problem)
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.out_dir))
        staged = save_figure(figure, self._staging / name)
        self._names.add(name)
        paths = [self.out_dir / path.name for path in staged]
        self.files.extend(paths)
        png = next(path for path in staged if path.suffix == ".png")
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        listed = " ".join(path.name for path in paths)
        self._parts.append(
            f'<figure><img alt="{html.escape(caption or name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)} <span class=files>[{html.escape(listed)}]</span>"
            "</figcaption></figure>"
        )
        if table is not None:
            self.table(*table)
        return paths

    def render(self) -> str:
        """The page as a string."""
        toc = " ".join(f'<a href="#{anchor}">{html.escape(text)}</a>' for anchor, text in self._sections)
        return (
            "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1><nav>{toc}</nav>"
            + "\n".join(self._parts)
            + "</body></html>\n"
        )

    def write(self, name: str = "index.html") -> Path:
        """Move the staged pictures beside the page, write the page into ``out_dir`` (atomically:
        a reader finds the old page or the whole new one) and return its path. A page it replaces
        lists the pictures it came with: those this report did not write again are removed (a
        report rewritten without ``--checkpoint`` left the capsule pictures of the last one beside
        a page that no longer shows them); no other file is touched.

        Args:
            name: the page's file name, in ``out_dir`` (no folder: the pictures stay there).

        Returns:
            The page's path.

        Raises:
            ValueError: a ``name`` that is a path (``../page.html`` was written outside
                ``out_dir``, ``sub/page.html`` away from its pictures), or empty.
        """
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"name must be a file name in out_dir, without folders, got {name!r}")
        path = self.out_dir / name
        stale = _listed_pictures(path) - {file.name for file in self.files}
        page = self.render().encode("utf-8")  # before any picture moves: a page that cannot be
        if self._staging is not None:  # encoded leaves the last report whole
            for staged in sorted(self._staging.iterdir()):
                os.replace(staged, self.out_dir / staged.name)
            self._staging.rmdir()
            self._staging = None
        atomic_write(path, lambda stream: stream.write(page))
        for file_name in sorted(stale):
            (self.out_dir / file_name).unlink(missing_ok=True)
        return path

    def discard(self) -> None:
        """Abandon what was added since the last :meth:`write` (after a failure while drawing):
        the staged pictures are deleted, the folder keeps what it held before, and the report is
        empty again."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self.files.clear()
        self._names.clear()
        self._parts.clear()
        self._sections.clear()


def _listed_pictures(page: Path) -> set[str]:
    """The picture files a page :class:`HtmlReport` wrote lists (``<span class=files>[a.png
    a.svg]</span>`` under each figure); none for a page that is not there or not one of ours."""
    try:
        text = page.read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError):
        return set()
    names = set()
    for listed in re.findall(r"<span class=files>\[([^\]<]*)\]</span>", text):
        names.update(html.unescape(listed).split())
    # only the names figure() writes: a stem of letters, digits, '-', '_' and a picture suffix
    return {n for n in names if re.fullmatch(r"[A-Za-z0-9_-]+\.(png|svg)", n)}


def _fmt(value: object) -> str:
    """A table cell's text: 4 significant digits for a real number that is not an integer."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return f"{float(value):.4g}"
    return str(value)
