"""EPUB 2 and 3 as a document, with the standard library (zipfile, ElementTree for the package files, html.parser
for the XHTML): the OPF's metadata (title, authors, language, cover), its spine as chapters in reading order, titled
from the table of contents (EPUB 3's nav, else EPUB 2's NCX) or the chapter's first heading. A DRM-protected book is
refused; fonts obfuscated as encryption.xml declares are not DRM and are read past."""

from __future__ import annotations

import posixpath
import zipfile
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
    "p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "blockquote", "dt", "dd", "pre", "tr", "th", "td",
    "section", "article", "aside", "header", "footer", "figcaption", "caption", "br", "hr", "body", "table", "ul", "ol",
}  # fmt: skip
_UNSPOKEN = {"script", "style", "head", "title", "rt", "rp", "svg", "math", "template"}
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
        self._words: list[str] = []
        self._skipping = 0
        self._in_heading = False
        self._link: list | None = None

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in _UNSPOKEN:
            self._skipping += 1
        elif tag in _BLOCKS:
            self._flush()
            self._in_heading = tag in _HEADINGS
        elif tag == "a" and (href := dict(attrs).get("href")):
            self._link = [href, []]
        elif tag == "img":  # an image's place is a word break
            self._words.append(" ")

    def handle_startendtag(self, tag: str, attrs) -> None:
        if tag in _BLOCKS:
            self._flush()
        elif tag == "img":
            self._words.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in _UNSPOKEN:
            self._skipping = max(self._skipping - 1, 0)
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
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as error:
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
    for method in book.xml("META-INF/encryption.xml", "encryption list").iterfind(".//{*}EncryptionMethod"):
        if method.get("Algorithm") not in FONT_OBFUSCATION:
            raise _drm(book.path)


def _drm(path: Path) -> DocumentError:
    return DocumentError(
        f"{path} is protected by DRM (its content is encrypted): rvqtts reads DRM-free EPUBs only; use a copy you "
        "are allowed to read as text"
    )


def _meta(metadata: ElementTree.Element | None, name: str) -> list[str]:
    return [] if metadata is None else [collapse(e.text or "") for e in metadata.iterfind(f".//{{*}}{name}") if e.text]


def _toc_titles(book: _Book, base: str, manifest: dict, spine: ElementTree.Element) -> dict[str, str]:
    """Each content file's first title in the table of contents (EPUB 3's nav document, else EPUB 2's NCX)."""
    titles: dict[str, str] = {}
    nav = next((item for item in manifest.values() if "nav" in item["properties"]), None)
    ncx = manifest.get(spine.get("toc") or "") or next(
        (item for item in manifest.values() if item["type"] == "application/x-dtbncx+xml"), None
    )
    if nav is not None and nav["href"] in book.names:
        folder = posixpath.dirname(nav["href"])
        for href, text in _parsed(book.read(nav["href"], "table of contents").decode("utf-8", "replace")).links:
            titles.setdefault(_resolve(folder, href), text)
    elif ncx is not None and ncx["href"] in book.names:
        folder = posixpath.dirname(ncx["href"])
        for point in book.xml(ncx["href"], "table of contents").iterfind(".//{*}navPoint"):
            label, content = point.find("{*}navLabel/{*}text"), point.find("{*}content")
            if label is not None and content is not None and content.get("src"):
                titles.setdefault(_resolve(folder, content.get("src")), collapse(label.text or ""))
    return {name: title for name, title in titles.items() if title}


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
        if item is None or item["type"] not in XHTML_TYPES:
            continue
        parsed = _parsed(book.read(item["href"], "chapter").decode("utf-8", "replace"))
        name = item["href"]
        if not parsed.blocks:
            notices.append(f"{posixpath.basename(name)} has no text (images only?): skipped")
        elif chapters and name not in titles and parsed.heading is None:
            chapters[-1][1].extend(parsed.blocks)
        else:
            chapters.append((titles.get(name) or parsed.heading or f"Section {len(chapters) + 1}", parsed.blocks))
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
