"""EPUB 2 and 3 as a document, with the standard library (zipfile, ElementTree for the package files, html.parser
for the XHTML): the OPF's metadata (title, authors, language, cover), its spine as chapters in reading order, titled
from the table of contents (EPUB 3's nav, else EPUB 2's NCX) or the chapter's first heading. A DRM-protected book is
refused; fonts obfuscated as encryption.xml declares are not DRM and are read past."""

from __future__ import annotations

import posixpath
import re
import zipfile
import zlib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote
from xml.etree import ElementTree

from rvqtts.documents.document import Chapter, Cover, Document, DocumentError, collapse

CONTAINER = "META-INF/container.xml"
# Font obfuscation (IDPF's and Adobe's): declared in encryption.xml, not DRM: the text is readable.
FONT_OBFUSCATION = {"http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC"}
XHTML_TYPES = {"application/xhtml+xml", "text/html"}
_BLOCKS = {
    "p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "blockquote", "dt", "dd", "tr", "th", "td",
    "section", "article", "aside", "header", "footer", "figcaption", "caption", "hr", "body", "table", "ul", "ol",
}  # fmt: skip
_UNSPOKEN = {"script", "style", "head", "title", "rt", "rp", "svg", "math", "template", "pre"}  # pre: code
# notes, note references and page numbers (EPUB 3's epub:type, DPUB-ARIA's role) are not read in the running text
_UNSPOKEN_KINDS = {"footnote", "endnote", "rearnote", "noteref", "pagebreak", "annoref"}
_FONT_SUFFIXES = (".ttf", ".otf", ".woff", ".woff2")
_XML_ENCODING = re.compile(rb"""^<\?xml[^>]*encoding=["']([A-Za-z0-9._-]+)["']""")
_HEADINGS = {"h1", "h2", "h3"}
MAX_MEMBER_BYTES = 64 * 2**20  # no single file of a book is bigger; a larger one is not read whole


class _TextBlocks(HTMLParser):
    """An XHTML file's text blocks in order (paragraphs, headings, list items), its first heading, and its links
    (href, text) where asked (a nav document's table of contents)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.heading: str | None = None
        self.links: list[tuple[str, str]] = []
        self.anchors: dict[str, int] = {}  # an element's id -> the block it opens or falls in
        self._words: list[str] = []
        self._skipping = 0
        self._in_heading = False
        self._link: list | None = None

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in _UNSPOKEN or (self._skipping and tag not in _VOID) or _is_note(attrs):
            self._skipping += 1
        elif tag in _BLOCKS:
            self._flush()
            self._in_heading = tag in _HEADINGS
        if not self._skipping and (anchor := dict(attrs).get("id")):
            self.anchors.setdefault(anchor, len(self.blocks))
        if self._skipping:
            return
        if tag == "a" and (href := dict(attrs).get("href")):
            self._link = [href, []]
        elif tag in ("img", "br"):  # a word break
            self._words.append(" ")

    def handle_startendtag(self, tag: str, attrs) -> None:
        if tag in _BLOCKS:
            self._flush()
        elif tag in ("img", "br"):
            self._words.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self._skipping:
            self._skipping -= 1
        elif tag in _BLOCKS:
            self._flush()
        elif tag == "a" and self._link is not None:
            self.links.append((self._link[0], collapse("".join(self._link[1]))))
            self._link = None

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self._words.append(data)
            if self._link is not None:
                self._link[1].append(data)

    def _flush(self) -> None:
        text = collapse("".join(self._words))
        self._words = []
        if text:
            self.blocks.append(text)
            if self._in_heading and self.heading is None:
                self.heading = text
        self._in_heading = False

    def close(self) -> None:
        super().close()
        self._flush()


_VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "source", "area", "base", "embed", "param"}


def _is_note(attrs) -> bool:
    """Whether an element is a note, a note reference or a page number, by its epub:type or role."""
    named = dict(attrs)
    kinds = (named.get("epub:type") or "").split() + [(named.get("role") or "").removeprefix("doc-")]
    return any(kind in _UNSPOKEN_KINDS for kind in kinds)


def _decoded(data: bytes) -> str:
    """An XHTML file's text: its byte order mark's or XML declaration's encoding, else UTF-8 (bad bytes replaced)."""
    for mark, encoding in ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16")):
        if data.startswith(mark):
            return data.decode(encoding, "replace")
    declared = _XML_ENCODING.match(data)
    try:
        return data.decode(declared.group(1).decode() if declared else "utf-8", "replace")
    except LookupError:
        return data.decode("utf-8", "replace")


def _parsed(markup: str) -> _TextBlocks:
    parser = _TextBlocks()
    parser.feed(markup)
    parser.close()
    return parser


class _Book:
    """An EPUB's zip archive, its members read by name with clear errors."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.archive = zipfile.ZipFile(path)
        except FileNotFoundError as error:
            raise DocumentError(f"{path}: no such file") from error
        except (zipfile.BadZipFile, OSError) as error:
            raise DocumentError(f"{path} is not an EPUB: not a zip archive ({error})") from error
        self.names = set(self.archive.namelist())

    def read(self, name: str, what: str) -> bytes:
        if name not in self.names:
            raise DocumentError(f"{self.path} is not a valid EPUB: its {what} {name} is missing")
        info = self.archive.getinfo(name)
        if info.file_size > MAX_MEMBER_BYTES:
            raise DocumentError(
                f"{self.path}: its {what} {name} is {info.file_size / 2**20:.0f} MiB, too large to read"
            )
        try:
            return self.archive.read(name)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, NotImplementedError) as error:
            raise DocumentError(f"{self.path}: cannot read its {what} {name}: {error}") from error

    def xml(self, name: str, what: str) -> ElementTree.Element:
        try:
            return ElementTree.fromstring(self.read(name, what))
        except ElementTree.ParseError as error:
            raise DocumentError(f"{self.path} is not a valid EPUB: its {what} {name} is not XML ({error})") from error


def _check_drm(book: _Book) -> None:
    """Refuse a book whose content is encrypted (DRM); obfuscated fonts are fine."""
    if "META-INF/rights.xml" in book.names:
        raise _drm(book.path)
    if "META-INF/encryption.xml" not in book.names:
        return
    for encrypted in book.xml("META-INF/encryption.xml", "encryption list").iterfind(".//{*}EncryptedData"):
        method = encrypted.find("{*}EncryptionMethod")
        target = encrypted.find(".//{*}CipherReference")
        font = target is not None and (target.get("URI") or "").lower().endswith(_FONT_SUFFIXES)
        if not font and (method is None or method.get("Algorithm") not in FONT_OBFUSCATION):
            raise _drm(book.path)


def _drm(path: Path) -> DocumentError:
    return DocumentError(
        f"{path} is protected by DRM (its content is encrypted): rvqtts reads DRM-free EPUBs only; use a copy you "
        "are allowed to read as text"
    )


def _meta(metadata: ElementTree.Element | None, name: str) -> list[str]:
    return [] if metadata is None else [collapse(e.text or "") for e in metadata.iterfind(f".//{{*}}{name}") if e.text]


def _toc_titles(book: _Book, base: str, manifest: dict, spine: ElementTree.Element) -> dict[str, list]:
    """Each content file's entries in the table of contents (EPUB 3's nav document, else EPUB 2's NCX), in order:
    (the fragment they point to, or None for the file's start; their title)."""
    titles: dict[str, list] = {}
    nav = next((item for item in manifest.values() if "nav" in item["properties"]), None)
    ncx = manifest.get(spine.get("toc") or "") or next(
        (item for item in manifest.values() if item["type"] == "application/x-dtbncx+xml"), None
    )
    if nav is not None and nav["href"] in book.names:
        folder = posixpath.dirname(nav["href"])
        for href, text in _parsed(_decoded(book.read(nav["href"], "table of contents"))).links:
            titles.setdefault(_resolve(folder, href), []).append((_fragment(href), text))
    elif ncx is not None and ncx["href"] in book.names:
        folder = posixpath.dirname(ncx["href"])
        try:
            points = list(book.xml(ncx["href"], "table of contents").iterfind(".//{*}navPoint"))
        except DocumentError:  # a damaged table of contents: the chapters are titled by their headings
            points = []
        for point in points:
            label, content = point.find("{*}navLabel/{*}text"), point.find("{*}content")
            if label is not None and content is not None and content.get("src"):
                src = content.get("src")
                titles.setdefault(_resolve(folder, src), []).append((_fragment(src), collapse(label.text or "")))
    return {name: [(part, title) for part, title in entries if title] for name, entries in titles.items()}


def _fragment(href: str) -> str | None:
    return unquote(href.split("#", 1)[1]) if "#" in href else None


def _sections(parsed: _TextBlocks, entries: list) -> list[tuple[str | None, list[str]]]:
    """A content file's blocks split where its table-of-contents entries point (a file holding several chapters),
    each part with its entry's title; the blocks before the first entry's place have none."""
    starts = sorted({parsed.anchors.get(part, 0) if part else 0: title for part, title in reversed(entries)}.items())
    if not starts or starts[0][0] > 0:
        starts.insert(0, (0, None))
    bounds = [start for start, _ in starts[1:]] + [len(parsed.blocks)]
    parts = [(title, parsed.blocks[start:end]) for (start, title), end in zip(starts, bounds)]
    return [(title, blocks) for title, blocks in parts if blocks]


def _resolve(folder: str, href: str) -> str:
    """A manifest or link href as the archive's member name (its fragment dropped)."""
    return posixpath.normpath(posixpath.join(folder, unquote(href.split("#", 1)[0])))


def read_epub(path: Path) -> Document:
    """An EPUB's metadata and chapters: one per spine item with text (linear="no" items, such as notes, left out), an
    item with neither a table-of-contents entry nor a heading continuing the chapter before it (a chapter split over
    files); items without text are skipped and said in the notices."""
    book = _Book(path)
    root = book.xml(CONTAINER, "container") if CONTAINER in book.names else None
    if root is None:
        raise DocumentError(f"{path} is not an EPUB: it has no {CONTAINER} (is it another kind of zip?)")
    rootfile = next((e.get("full-path") for e in root.iterfind(".//{*}rootfile") if e.get("full-path")), None)
    if rootfile is None:
        raise DocumentError(f"{path} is not a valid EPUB: its container names no package file")
    _check_drm(book)
    package = book.xml(rootfile, "package file")
    base = posixpath.dirname(rootfile)
    manifest = {
        item.get("id"): {
            "href": _resolve(base, item.get("href", "")),
            "type": item.get("media-type", ""),
            "properties": (item.get("properties") or "").split(),
        }
        for item in package.iterfind(".//{*}item")
    }
    spine = package.find("{*}spine")
    refs = [] if spine is None else [r for r in spine.iterfind(".//{*}itemref") if r.get("linear", "yes") != "no"]
    if not refs:
        raise DocumentError(f"{path} is not a valid EPUB: its package file has no spine (no reading order)")
    metadata = package.find("{*}metadata")
    titles = _toc_titles(book, base, manifest, spine)
    chapters: list[tuple[str, list[str]]] = []
    notices: list[str] = []
    for ref in refs:
        item = manifest.get(ref.get("idref"))
        if item is None or item["type"] not in XHTML_TYPES or "nav" in item["properties"]:
            continue
        if item["href"] not in book.names:
            notices.append(f"{item['href']} is in the reading order but not in the book: skipped")
            continue
        parsed = _parsed(_decoded(book.read(item["href"], "chapter")))
        name = item["href"]
        if not parsed.blocks:
            notices.append(f"{posixpath.basename(name)} has no text (images only?): skipped")
        for title, blocks in _sections(parsed, titles.get(name, [])):
            if chapters and title is None and parsed.heading is None:  # a chapter split over files goes on
                chapters[-1][1].extend(blocks)
            else:
                chapters.append((title or parsed.heading or f"Section {len(chapters) + 1}", blocks))
    authors = _meta(metadata, "creator")
    return Document(
        title=next(iter(_meta(metadata, "title")), path.stem),
        chapters=tuple(Chapter(title, tuple(blocks)) for title, blocks in chapters),
        author=", ".join(authors) or None,
        language=next(iter(_meta(metadata, "language")), None),
        cover=_cover(book, package, manifest, metadata),
        notices=tuple(notices),
    )


def _cover(book: _Book, package, manifest: dict, metadata) -> Cover | None:
    """The cover image: EPUB 3's cover-image item, else EPUB 2's <meta name="cover">."""
    item = next((item for item in manifest.values() if "cover-image" in item["properties"]), None)
    if item is None and metadata is not None:
        named = next((m.get("content") for m in metadata.iterfind(".//{*}meta") if m.get("name") == "cover"), None)
        item = manifest.get(named)
    if item is None or item["href"] not in book.names or not item["type"].startswith("image/"):
        return None
    return Cover(book.read(item["href"], "cover"), item["type"])
