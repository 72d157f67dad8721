"""Documents read into chapters (EPUB, Markdown, plain text), planned into chunks with their seeds, and every bad
input refused with one line before any model work (rvqtts.documents)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from rvqtts.documents.captions import Cue, sentence_cues, srt, webvtt
from rvqtts.documents.document import DocumentError
from rvqtts.documents.lexicon import Lexicon, read_lexicon
from rvqtts.documents.plan import MAX_SENTENCE_CHARS, chunk_seed, parse_chapters, plan_chapter, plan_document
from rvqtts.documents.reading import read_document
from rvqtts.synthesis.text import text_weight
from tests.helpers import run_cli

KEEPER = Path(__file__).parent / "data" / "keeper.md"
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000")  # a header is enough here

OPF = """<?xml version="1.0" encoding="utf-8"?>
<package xmlns="http://www.idpf.org/2007/opf" version="{version}" unique-identifier="id">
 <metadata xmlns:dc="http://purl.org/dc/elements/1.1/">
  <dc:title>The Small Book</dc:title><dc:creator>Ada Writer</dc:creator><dc:creator>Bo Second</dc:creator>
  <dc:language>en-GB</dc:language><dc:identifier id="id">urn:x</dc:identifier>{cover_meta}
 </metadata>
 <manifest>{items}</manifest>
 <spine{toc}>{refs}</spine>
</package>"""


def make_epub(
    path: Path,
    chapters: list[tuple[str, str]],
    version: str = "3.0",
    extra: dict[str, bytes] | None = None,
    spine: bool = True,
) -> Path:
    """A small EPUB: `chapters` as (file name, XHTML body), a table of contents (EPUB 3's nav or EPUB 2's NCX)
    titling all but files named "untitled*", a cover image, and `extra` members."""
    items = [
        f'<item id="c{i}" href="text/{name}" media-type="application/xhtml+xml"/>'
        for i, (name, _) in enumerate(chapters)
    ]
    refs = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters))) if spine else ""
    titled = [(name, f"Title of {name}") for name, _ in chapters if not name.startswith("untitled")]
    if version.startswith("3"):
        items.append('<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>')
        items.append('<item id="cover" href="cover.png" media-type="image/png" properties="cover-image"/>')
        links = "".join(f'<li><a href="text/{name}#top">{title}</a></li>' for name, title in titled)
        toc = {"OEBPS/nav.xhtml": f'<html><body><nav epub:type="toc"><ol>{links}</ol></nav></body></html>'}
        cover_meta, toc_attribute = "", ""
    else:
        items.append('<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>')
        items.append('<item id="cover-img" href="cover.png" media-type="image/png"/>')
        points = "".join(
            f'<navPoint id="n{i}"><navLabel><text>{title}</text></navLabel><content src="text/{name}"/></navPoint>'
            for i, (name, title) in enumerate(titled)
        )
        toc = {"OEBPS/toc.ncx": f'<ncx xmlns="http://www.daisy.org/z3986/2005/ncx/"><navMap>{points}</navMap></ncx>'}
        cover_meta, toc_attribute = '<meta name="cover" content="cover-img"/>', ' toc="ncx"'
    opf = OPF.format(version=version, cover_meta=cover_meta, items="".join(items), toc=toc_attribute, refs=refs)
    container = (
        '<container xmlns="urn:oasis:names:tc:opendocument:xmlns:container" version="1.0"><rootfiles>'
        '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>'
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("mimetype", "application/epub+zip")
        archive.writestr("META-INF/container.xml", container)
        archive.writestr("OEBPS/content.opf", opf)
        archive.writestr("OEBPS/cover.png", PNG)
        for name, body in chapters:
            archive.writestr(f"OEBPS/text/{name}", f"<html><head><title>x</title></head><body>{body}</body></html>")
        for name, data in {**toc, **(extra or {})}.items():
            archive.writestr(name, data)
    return path


CHAPTERS = [
    ("cover.xhtml", '<div><img src="../cover.png" alt="The cover"/></div>'),
    ("one.xhtml", "<h1>One</h1><p>It was a <em>bright</em> cold day.</p><p>The clocks&#160;struck thirteen.</p>"),
    ("untitled-split.xhtml", "<p>Still chapter one, <span>split</span> over files.</p><script>no()</script>"),
    ("two.xhtml", "<h2>Two</h2><ul><li>First item</li><li>Second item</li></ul><style>p {}</style>"),
]


@pytest.mark.parametrize("version", ["3.0", "2.0"])
def test_an_epub_gives_its_metadata_and_chapters_in_spine_order(tmp_path, version):
    book = read_document(make_epub(tmp_path / "book.epub", CHAPTERS, version))
    assert (book.title, book.author, book.language) == ("The Small Book", "Ada Writer, Bo Second", "en-GB")
    assert book.cover.data == PNG and book.cover.media_type == "image/png"
    assert [chapter.title for chapter in book.chapters] == ["Title of one.xhtml", "Title of two.xhtml"]
    assert book.chapters[0].paragraphs == (
        "One",
        "It was a bright cold day.",
        "The clocks struck thirteen.",
        "Still chapter one, split over files.",
    )
    assert book.chapters[1].paragraphs == ("Two", "First item", "Second item")
    assert book.notices == ("cover.xhtml has no text (images only?): skipped",)


def test_an_epubs_notes_page_numbers_and_line_breaks_are_not_paragraphs(tmp_path):
    body = (
        '<p>It rained.<a epub:type="noteref" href="#n1"><sup>1</sup></a> It stopped.<span role="doc-pagebreak">12'
        '</span></p><p>A line<br/>broken.</p><aside epub:type="footnote" id="n1"><p>A note.</p></aside>'
    )
    book = read_document(make_epub(tmp_path / "book.epub", [("one.xhtml", body), ("gone.xhtml", "")], extra={}))
    assert book.chapters[0].paragraphs == ("It rained. It stopped.", "A line broken.")


def test_an_epub_part_missing_or_damaged_is_said_or_refused_in_one_line(tmp_path):
    whole = zipfile.ZipFile(make_epub(tmp_path / "whole.epub", CHAPTERS))

    def copy(path: Path, change) -> Path:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for name in whole.namelist():
                if (data := change(name, whole.read(name))) is not None:
                    archive.writestr(name, data)
        return path

    lost = copy(tmp_path / "lost.epub", lambda name, data: None if name.endswith("two.xhtml") else data)
    assert "OEBPS/text/two.xhtml is in the reading order but not in the book: skipped" in read_document(lost).notices
    long = copy(tmp_path / "damaged.epub", lambda name, data: data * 50 if name.endswith("one.xhtml") else data)
    data = bytearray(long.read_bytes())
    start = data.index(b"OEBPS/text/one.xhtml") + 40
    data[start : start + 200] = bytes(200)  # the chapter's compressed bytes zeroed
    long.write_bytes(bytes(data))
    with pytest.raises(DocumentError, match="cannot read its chapter OEBPS/text/one.xhtml"):
        read_document(long)


def test_markdown_front_matter_is_not_spoken(tmp_path):
    path = tmp_path / "post.md"
    path.write_text(
        "---\ntitle: My post\ndate: 2024-01-01\n---\n# Title\n\n## One\n\nText one.\n\n## Two\n\nText two.\n"
    )
    book = read_document(path)
    assert book.title == "Title" and [c.title for c in book.chapters] == ["One", "Two"]
    assert "date" not in " ".join(p for c in book.chapters for p in c.paragraphs)


def test_a_file_holding_several_chapters_is_split_where_the_contents_point(tmp_path):
    body = (
        '<h1 id="t">A Book</h1><p>Opening.</p><h2 id="c1">One</h2><p>First.</p><pre>code()</pre>'
        '<section id="c2"><h2>Two</h2><p>Second.</p></section>'
    )
    links = '<li><a href="text/one.xhtml#c1">Chapter One</a></li><li><a href="text/one.xhtml#c2">Chapter Two</a></li>'
    nav = {"OEBPS/nav.xhtml": f'<html><body><nav epub:type="toc"><ol>{links}</ol></nav></body></html>'}
    book = read_document(make_epub(tmp_path / "book.epub", [("one.xhtml", body)], extra=nav))
    assert [(c.title, c.paragraphs) for c in book.chapters] == [
        ("A Book", ("A Book", "Opening.")),
        ("Chapter One", ("One", "First.")),
        ("Chapter Two", ("Two", "Second.")),
    ]


def test_an_epub_without_a_table_of_contents_is_titled_by_headings(tmp_path):
    path = make_epub(tmp_path / "book.epub", [("untitled-a.xhtml", "<h1>Alpha</h1><p>Text.</p>")])
    assert read_document(path).chapters[0].title == "Alpha"


def test_obfuscated_fonts_are_not_drm_but_encrypted_text_is(tmp_path):
    def encryption(algorithm: str, target: str) -> dict[str, bytes]:
        return {
            "META-INF/encryption.xml": (
                '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
                'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData>'
                f'<enc:EncryptionMethod Algorithm="{algorithm}"/><enc:CipherData>'
                f'<enc:CipherReference URI="{target}"/></enc:CipherData></enc:EncryptedData></encryption>'
            ).encode()
        }

    aes = "http://www.w3.org/2001/04/xmlenc#aes128-cbc"
    for algorithm, target in [("http://www.idpf.org/2008/embedding", "OEBPS/a.xhtml"), (aes, "OEBPS/fonts/a.otf")]:
        assert read_document(make_epub(tmp_path / "fonts.epub", CHAPTERS, extra=encryption(algorithm, target))).chapters
    with pytest.raises(DocumentError, match="protected by DRM"):
        read_document(make_epub(tmp_path / "drm.epub", CHAPTERS, extra=encryption(aes, "OEBPS/text/one.xhtml")))


def test_markdown_chapters_at_headings_without_code_or_markup():
    book = read_document(KEEPER)
    assert book.title == "The Keeper of the Northern Light"
    assert [c.title for c in book.chapters] == [
        "Chapter One: The Storm",
        "Chapter Two: The Ship",
        "Chapter Three: The Morning",
    ]
    assert book.chapters[0].paragraphs[:3] == (
        "The Keeper of the Northern Light",
        "A short story in three chapters, written for rvqtts's tests and benchmarks. Free to use.",
        "Chapter One: The Storm",
    )
    spoken = " ".join(p for chapter in book.chapters for p in chapter.paragraphs)
    assert "01:10" not in spoken and "*" not in spoken  # the code block and the emphasis marks
    assert "The letter said only three words: Thank you, keeper." in spoken
    assert book.chapters[2].paragraphs[-4:-1] == (
        "She counted the steps.",
        "She trimmed the wick.",
        "She wrote the date in the log.",
    )


def test_plain_text_chapters_at_heading_lines_and_its_encoding(tmp_path):
    text = "Opening words.\n\nCHAPTER ONE\n\nThe Storm\n\nIt was dark.\nVery dark.\n\nChapter 2\n\nMore text here.\n"
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="latin-1")
    book = read_document(path)
    assert [c.title for c in book.chapters] == ["CHAPTER ONE", "Chapter 2"]
    assert book.chapters[0].paragraphs == ("Opening words.", "CHAPTER ONE", "The Storm", "It was dark. Very dark.")
    path.write_text("Café au lait.\n", encoding="latin-1")
    with pytest.raises(DocumentError, match="not UTF-8 text .* --encoding"):
        read_document(path)
    assert read_document(path, encoding="latin-1").chapters[0].paragraphs == ("Café au lait.",)


def test_chunks_hold_whole_sentences_with_seeds_from_their_place():
    book = read_document(KEEPER)
    plans = plan_document(book, seed=7)
    assert [len(plan.chunks) for plan in plans] == [7, 6, 7]
    for plan in plans:
        for chunk in plan.chunks:
            assert text_weight(chunk.text) <= 240
            assert chunk.seed == chunk_seed(7, plan.number, chunk.number)
            assert sum(share for _, share in chunk.sentences) == pytest.approx(1.0)
    # the rule docs/documents.md gives: the first 31 bits of SHA-256("7:2:3")
    assert chunk_seed(7, 2, 3) == int.from_bytes(hashlib.sha256(b"7:2:3").digest()[:4], "big") >> 1
    assert chunk_seed(0, 1, 1) != chunk_seed(0, 1, 2) != chunk_seed(1, 1, 2)
    assert plan_document(book, seed=7) == plans  # the same every time


def test_the_lexicon_changes_what_is_said_and_not_the_captions(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("# how to say them\nMara = Marra\nnorthern light = North Light\n", encoding="utf-8")
    lexicon = read_lexicon(path)
    plan = plan_chapter(read_document(KEEPER), 1, seed=0, lexicon=lexicon)
    spoken = " ".join(chunk.text for chunk in plan.chunks)
    assert "Marra had kept the North Light" in spoken and "Mara " not in spoken
    assert any(sentence.startswith("Mara had kept the northern light") for sentence in plan.sentences)
    assert Lexicon({"US": "U S"}).apply("The US bus, us.") == "The U S bus, us."
    path.write_text("no equals sign here\n")
    with pytest.raises(DocumentError, match=r"words.txt:1: a lexicon entry is `written = spoken`"):
        read_lexicon(path)


def test_captions_give_each_sentence_its_share_of_its_chunks():
    cues = sentence_cues([(0.0, 2.0, ((1, 0.25), (2, 0.75))), (2.5, 4.5, ((2, 0.5), (3, 0.5)))], ("A.", "B c d.", "E."))
    assert cues == [Cue(0.0, 0.5, "A."), Cue(0.5, 3.5, "B c d."), Cue(3.5, 4.5, "E.")]
    assert srt(cues[:1]) == "1\n00:00:00,000 --> 00:00:00,500\nA.\n\n"
    assert webvtt([Cue(3661.5, 3662.0, "a < b & c")]) == "WEBVTT\n\n01:01:01.500 --> 01:01:02.000\na &lt; b &amp; c\n\n"


def test_chapter_selections():
    assert parse_chapters("3", 5) == [3] and parse_chapters("1,3-4", 5) == [1, 3, 4]
    for bad in ("0", "2-9", "x", "3-1", "2-"):
        with pytest.raises(DocumentError, match="--chapters"):
            parse_chapters(bad, 5)


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Every bad document the issue names, and the words its one line must hold."""
    not_zip = tmp_path / "fake.epub"
    not_zip.write_text("just text")
    other_zip = tmp_path / "other.epub"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("readme.txt", "hello")
    no_spine = make_epub(tmp_path / "nospine.epub", CHAPTERS, spine=False)
    drm = make_epub(tmp_path / "drm.epub", CHAPTERS, extra={"META-INF/rights.xml": b"<rights/>"})
    images = make_epub(tmp_path / "images.epub", CHAPTERS[:1])
    empty = tmp_path / "empty.md"
    empty.write_text("```\ncode only\n```\n")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Déjà vu.".encode("latin-1"))
    endless = tmp_path / "endless.txt"
    endless.write_text("word " * 20_000)
    return {
        "not a zip": (not_zip, "is not an EPUB: not a zip archive"),
        "no container": (other_zip, "has no META-INF/container.xml"),
        "no spine": (no_spine, "has no spine"),
        "drm": (drm, "protected by DRM"),
        "images only": (images, "nothing to say"),
        "empty": (empty, "nothing to say"),
        "not utf-8": (latin, "--encoding"),
        "no punctuation": (endless, f"more than {MAX_SENTENCE_CHARS:,}"),
    }


def test_every_bad_document_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    out = tmp_path / "out"
    for name, (path, words) in _bad_inputs(tmp_path).items():
        result = run_cli("read", path, "--out-dir", out, "--model", tmp_path / "never-loaded")
        assert result.exit_code == 2, (name, result.output)
        message = result.output.strip()
        assert message.startswith("rvqtts: error: ") and "\n" not in message and words in message, (name, message)
        assert not out.exists(), name


def test_read_refuses_options_before_reading(tmp_path):
    for arguments, words in [
        ((), "--out-dir"),
        (("--out-dir", tmp_path / "o", "--format", "aiff"), "chapter files can be wav, flac, ogg, mp3, opus, not aiff"),
        (("--out-dir", tmp_path / "o", "--chapters", "3-1"), "a range goes from the lower number to the higher"),
        (("--out-dir", tmp_path / "o", "--paragraph-pause", "-1"), "paragraph pause must be 0 to 60"),
        (("--out-dir", tmp_path / "o", "--chapters", "9"), "chapters 1 to 3"),
        (("--out-dir", tmp_path / "o", "--kind", "pdf"), "unknown document kind"),
    ]:
        result = run_cli("read", KEEPER, *arguments)
        assert result.exit_code == 2 and words in result.output, (arguments, result.output)


def test_loudness_measured_block_by_block_is_pyloudnorms():
    import numpy as np
    import pyloudnorm

    from rvqtts.documents.loudness import LoudnessMeter

    rng = np.random.default_rng(0)
    signal = rng.standard_normal(24000 * 6) * np.repeat(rng.uniform(0.001, 0.2, 60), 2400)  # loud and quiet stretches
    meter = LoudnessMeter(24000)
    for start in range(0, signal.size, 7001):  # blocks that cut its 100 ms steps anywhere
        meter.push(signal[start : start + 7001])
    assert meter.integrated() == pytest.approx(pyloudnorm.Meter(24000).integrated_loudness(signal), abs=1e-6)
    silent = LoudnessMeter(24000)
    silent.push(np.zeros(24000))
    assert silent.integrated() == float("-inf")
