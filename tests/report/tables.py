"""Read the report's tables back through their data attributes (shared by the HTML and browser tests)."""

from __future__ import annotations

from html.parser import HTMLParser


class TableReader(HTMLParser):
    """Collects {table id: [{data-key: data-value, "label": data-label}, ...]} from the report,
    the images, and the header (`about`: {data-key: text shown})."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[dict[str, str]]] = {}
        self.images: list[dict[str, str]] = []
        self.about: dict[str, str] = {}
        self._table: str | None = None
        self._about_key: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table and "data-label" in a:
            self.tables[self._table].append({"label": a["data-label"]})
        elif tag == "td" and self._table and "data-key" in a and "data-value" in a:
            self.tables[self._table][-1][a["data-key"]] = a["data-value"]
        elif tag == "img":
            self.images.append(a)
        elif tag == "dd" and "data-key" in a:
            self._about_key = a["data-key"]
            self.about[self._about_key] = ""

    def handle_data(self, data: str) -> None:
        if self._about_key:
            self.about[self._about_key] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = None
        elif tag == "dd":
            self._about_key = None


def read_tables(html: str) -> TableReader:
    reader = TableReader()
    reader.feed(html)
    return reader
