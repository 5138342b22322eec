"""The published GPU memory validation set (benchmarks/published/memory.toml): every row keeps its source
and the text it was read from, converts its figure exactly, and describes a recipe anatomist accepts.

The fast tests read the file and check each row's recipe against anatomist's own validation (no model is
built); the slow test resolves each run's recipe against its model, as `memory.py check` does before it
estimates (the estimates themselves take minutes on 2 cores: `memory.py check`, memory_check.txt).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from anatomist.hardware import get_gpu
from anatomist.model_config import catalog_names
from anatomist.recipe import Recipe

PUBLISHED = Path(__file__).parents[1] / "benchmarks" / "published"
sys.path.insert(0, str(PUBLISHED))
import memory  # noqa: E402  (benchmarks/published/memory.py)

DATA = tomllib.loads((PUBLISHED / "memory.toml").read_text())
ROWS = DATA["rows"]
RUN_FIELDS = ("source", "model", "task", "seq_len", "gpu", "num_gpus", "recipe", "fsdp_version")


def test_every_source_says_where_and_how_it_measured() -> None:
    ids = [s["id"] for s in DATA["sources"]]
    assert len(ids) == len(set(ids))
    for source in DATA["sources"]:
        for key in ("where", "url", "what", "measured_by"):
            assert source.get(key, "").strip(), (source["id"], key)


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_row_has_its_source_quote_and_exact_bytes(row: dict) -> None:
    assert row["source"] in {s["id"] for s in DATA["sources"]}
    assert row["quote"].strip()
    assert row["quantity"] in memory.QUANTITIES
    assert row["unit"] in (*memory.UNIT_BYTES, "percent")
    # 14949 MiB -> 14949 * 2**20 = 15675162624; 23.92 % of 95.0396 GiB -> 24409880035 (rounded to the byte)
    assert row["value_bytes"] == memory.published_bytes(row)
    if row["unit"] in ("MiB", "MB", "bytes"):  # a published integer, not a rounded reading: quoted as printed
        assert str(row["published"]) in row["quote"]


def test_unit_conversions() -> None:
    assert memory.published_bytes({"unit": "MiB", "published": 14949}) == 14949 * 1024 * 1024
    assert memory.published_bytes({"unit": "percent", "published": 50, "percent_of_gib": 2}) == 2**30


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_row_maps_to_a_valid_recipe(row: dict) -> None:
    get_gpu(row["gpu"])  # raises on a name the catalog does not know
    assert row["model"] in catalog_names() or (PUBLISHED / "configs" / f"{row['model']}.json").is_file()
    recipe = Recipe.from_dict(row["recipe"], source=row["id"])  # raises on an unknown field or a bad value
    assert recipe.per_device_train_batch_size == row["recipe"]["per_device_train_batch_size"]
    if row["num_gpus"] > 1:
        assert recipe.fsdp != "none" or recipe.zero_stage, "several GPUs: the row must say how it shards"


def test_rows_are_unique_and_a_run_has_one_setting() -> None:
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    runs: dict[str, dict] = {}
    for row in ROWS:
        settings = {k: row.get(k) for k in RUN_FIELDS}
        assert runs.setdefault(row["run"], settings) == settings, row["id"]
        assert [r["quantity"] for r in ROWS if r["run"] == row["run"]].count(row["quantity"]) == 1, row["id"]


def test_every_regime_has_rows_and_fsdp1_runs_stand_apart() -> None:
    assert {memory.regime(r) for r in ROWS} == set(memory.REGIMES)
    assert {memory.regime(r) for r in ROWS if r.get("fsdp_version") == 1} == {memory.REGIMES[3]}


def test_left_out_entries_say_where_and_why() -> None:
    assert DATA["left_out"]
    for entry in DATA["left_out"]:
        assert entry["where"].strip() and entry["reason"].strip() and entry["figures"].strip()


@pytest.mark.slow
def test_each_run_resolves_against_its_model(tmp_path: Path) -> None:
    seen = set()
    for row in ROWS:
        if row["run"] in seen:
            continue
        seen.add(row["run"])
        folder = tmp_path / str(len(seen))
        folder.mkdir()
        work = memory.workload(row, folder)
        recipe = Recipe.from_dict(row["recipe"], source=row["id"]).resolved(work)
        work.for_recipe(recipe)
        assert work.seq_len == row["seq_len"]
