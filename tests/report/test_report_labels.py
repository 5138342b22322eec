"""Recipes shown together are named by what sets them apart; the charts draw the limit that decides "fits"; labels
never cover each other; nothing is printed while the report is drawn."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest

from anatomist.recipe import Recipe
from anatomist.recipe_labels import differing, labels, shared, summary
from anatomist.report import charts, write_report
from anatomist.report.load import load
from tests.report.tables import read_tables

GIB = 2**30


def _with(estimate: dict, **recipe: object) -> dict:
    other = copy.deepcopy(estimate)
    other["recipe"].update(recipe)
    return other


def test_two_recipes_that_differ_only_in_liger_are_named_by_it(tmp_path: Path, estimate_json: dict) -> None:
    liger, plain = _with(estimate_json, use_liger_kernel=True), _with(estimate_json, use_liger_kernel=False)
    ax = charts.memory_anatomy(load([liger, plain]).results).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bs4, Liger", "bs4, no Liger"]  # first input on top
    html = write_report([liger, plain], tmp_path / "r.html").read_text()
    assert [row["label"] for row in read_tables(html).tables["table-memory"]] == ["bs4, Liger", "bs4, no Liger"]


def test_labels_name_each_facet_that_differs_and_only_those() -> None:
    base = Recipe(per_device_train_batch_size=2, gradient_checkpointing=True, bf16=True)
    recipes = [base, Recipe(**{**base.to_dict(), "torch_compile": True}),
               Recipe(**{**base.to_dict(), "peft": "lora"}), Recipe(**{**base.to_dict(), "zero_stage": 3})]
    assert [f.key for f in differing(recipes, 4)] == ["method", "batch", "compile", "sharding"]
    # method full/LoRA, compile, sharding ddp (several GPUs, no ZeRO) or zero3; the batch always
    assert labels(recipes, 4) == ["full, bs2, no compile, ddp", "full, bs2, compile, ddp", "LoRA, bs2, no compile, ddp",
                                  "full, bs2, no compile, zero3"]
    assert shared(recipes, 4).startswith("checkpointing on, bf16, ")
    assert "Liger Kernel off" in summary(base) and "Cut Cross-Entropy off" in summary(base)


def test_the_memory_chart_draws_the_usable_limit_beside_the_capacity(estimate_json: dict) -> None:
    capacity = estimate_json["gpu"]["memory_bytes"]
    given = {**estimate_json, "limit_bytes": int(capacity * 0.9), "memory_margin": 0.1}
    fig = charts.memory_anatomy(load(given).results)
    lines = {line.get_label(): line.get_xdata()[0] for line in fig.axes[0].get_lines()}
    assert lines == {"V100-16GB: 15.8 GiB": capacity / GIB,
                     "usable (V100-16GB less the margin): 14.2 GiB": int(capacity * 0.9) / GIB}


def _plan(points: int) -> dict:
    """A plan whose Pareto points crowd together: memory 10.0, 10.1, ... GiB, speed 5.0, 5.05, ..."""
    entries = []
    for i, (optim, compiled) in zip(range(points), itertools.product(("adamw_torch_fused", "adafactor", "sgd"),
                                                                    (False, True)), strict=False):
        memory = {k: 0 for k in ("weights", "optimizer_states", "gradients", "activations", "temporary",
                                 "functionality", "runtime_overhead", "peak_allocated", "peak_reserved")}
        memory.update(weights=int((10 + 0.1 * i) * GIB), device_total=int((10 + 0.1 * i) * GIB), peak_phase="backward")
        entries.append({"recipe": {"per_device_train_batch_size": 2 ** (i % 3), "optim": optim, "torch_compile": compiled},
                        "memory": memory, "time": {"samples_per_second": 5 + 0.05 * i}, "reasons": []})
    return {"model": "gpt2", "gpu": {"name": "A100-80GB", "memory_bytes": 80 * GIB}, "limit_bytes": 72 * GIB,
            "candidates": points, "feasible": points, "pareto": entries, "best": entries[-1]}


@pytest.mark.filterwarnings("error")  # matplotlib's constrained_layout warning included
def test_point_labels_never_overlap_nor_leave_the_figure(tmp_path: Path) -> None:
    fig = charts.throughput_vs_memory(load(_plan(6)).results)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    texts = [t for t in fig.axes[0].texts if t.get_text()]
    assert len(texts) == 6 and len({t.get_text() for t in texts}) == 6  # each point named, each apart
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer) for t in texts]  # the text itself, not its line to the point
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)
    width, height = fig.bbox.width, fig.bbox.height
    assert all(0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height for box in boxes)
    assert write_report(_plan(6), tmp_path / "plan.html", png_dir=tmp_path / "png").exists()  # no warning either
