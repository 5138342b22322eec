"""Results store: header, corrupt lines named, torn last line dropped, append is durable."""

from __future__ import annotations

import json

import pytest

from anatomist.bench.store import ROW_KEYS, open_results
from anatomist.errors import InputError


def _row(name: str) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(name=name, status="ok", suite="s")
    return row


def test_new_file_gets_header_and_rows_round_trip(tmp_path):
    path = tmp_path / "r.jsonl"
    store = open_results(path)
    store.append(_row("a"))
    store.append(_row("b"))
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["anatomist_results"] == 1
    assert [r["name"] for r in open_results(path).rows] == ["a", "b"]


def test_corrupt_line_is_named_and_file_untouched(tmp_path):
    path = tmp_path / "r.jsonl"
    store = open_results(path)
    store.append(_row("a"))
    with path.open("a") as fh:
        fh.write("{not json\n")
    before = path.read_bytes()
    with pytest.raises(InputError, match="line 3 is corrupt"):
        open_results(path)
    assert path.read_bytes() == before


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises(InputError, match="not an anatomist results file"):
        open_results(path)
    assert path.read_text() == "hello\n"


def test_row_missing_keys_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    open_results(path)
    with path.open("a") as fh:
        fh.write(json.dumps({"name": "x"}) + "\n")
    with pytest.raises(InputError, match="line 2: not an anatomist result row"):
        open_results(path)


def test_torn_last_line_is_dropped_finished_rows_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    store = open_results(path)
    store.append(_row("a"))
    with path.open("a") as fh:
        fh.write('{"name": "b", "sta')  # a write cut short by a kill: no newline
    reopened = open_results(path)
    assert [r["name"] for r in reopened.rows] == ["a"]
    assert path.read_text().endswith("\n")
