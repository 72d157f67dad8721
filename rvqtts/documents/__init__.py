"""Documents to audio: books and articles read into chapters of paragraphs (EPUB, Markdown, plain text), planned
into chunks with their seeds, spoken B rows at a time and assembled into chapter files, captions and an audiobook
(docs/documents.md)."""
