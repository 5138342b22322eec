"""The page in headless Chromium, as a user drives it: a model and a GPU, the anatomy, another batch, a
shared link, a plan and its files loaded by the real libraries, and bad input said in one line.

Needs the Debian packages chromium and chromium-driver (scripts/install_browser.sh) and selenium (the
`dev` extra); without them the test skips and says why. With ANATOMIST_WEB_SCREENSHOT=PATH it also
estimates a catalog model and saves the page as PATH (the README's screenshot).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.headless import start_chromium
from tests.web.conftest import LiveServer

pytestmark = pytest.mark.browser

WAIT_S = 240


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory, downloads: Path) -> Iterator[Any]:
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"), window="1280,1500", downloads=downloads)
    yield driver
    driver.quit()


def _until(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S, driver: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            said = _js(driver, "return document.getElementById('error').innerText;") if driver is not None else ""
            shown = f"; the page's error box says: {said}" if said else ""
            raise AssertionError(f"timed out waiting for {what}{shown}")
        time.sleep(0.1)


def _js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def _open(driver: Any, url: str) -> None:
    driver.get(url)
    _until(lambda: _js(driver, "return document.body.dataset.ready === '1';"), "the page's form")


def _answered(driver: Any, selector: str) -> None:
    """Wait until the job is over (no status line) and `selector` or the error box is shown."""
    _until(lambda: _js(driver, "return document.getElementById('status').hidden && (!!document.querySelector(arguments[0])"
                               " || !document.getElementById('error').hidden);", selector), selector, driver=driver)
    error = _js(driver, "const e = document.getElementById('error'); return e.hidden ? null : e.innerText;")
    assert error is None, error


def _type(driver: Any, element_id: str, text: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def _click(driver: Any, selector: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, selector).click()


def _text(driver: Any, element_id: str) -> str:
    return str(_js(driver, "return document.getElementById(arguments[0]).innerText;", element_id))


def _anatomy(driver: Any) -> dict[str, int]:
    return {k: int(v) for k, v in _js(driver, """
        return Object.fromEntries(Array.from(document.querySelectorAll('#table-anatomy [data-key][data-value]'))
          .map(td => [td.dataset.key, td.dataset.value]));""").items()}


def _charts_loaded(driver: Any) -> list[str]:
    return _until(lambda: _js(driver, """
        const imgs = Array.from(document.querySelectorAll('img.chart'));
        return imgs.length && imgs.every(i => i.complete && i.naturalWidth > 0) ? imgs.map(i => i.dataset.chart) : null;"""),
        "the charts")


def _download(driver: Any, folder: Path, name: str) -> Path:
    target = folder / name
    target.unlink(missing_ok=True)
    _click(driver, f"a[data-file='{name}']")
    return _until(lambda: target if target.exists() and target.stat().st_size > 0 else None, f"download of {name}", 30)


@pytest.mark.slow
def test_the_page_from_a_model_to_the_files_of_a_plan(browser: Any, live: LiveServer, tiny_config: Path,
                                                     downloads: Path, tmp_path: Path) -> None:
    d = browser
    _open(d, live.url)
    # A model (an uploaded config.json) and a GPU: the memory anatomy, the verdict, the time.
    d.find_element("id", "f-config-file").send_keys(str(tiny_config))
    _until(lambda: _text(d, "f-config-name") == "config.json", "the upload")
    _type(d, "f-gpu", "A100-80GB")
    _type(d, "f-seq_len", "64")
    _click(d, "#run")
    _answered(d, "#verdict")
    assert _text(d, "summary").startswith("uploaded llama config.json (causal-lm, ")
    assert "batch 8 x 1" in _text(d, "summary") and "on A100-80GB" in _text(d, "summary")
    first = _anatomy(d)
    assert sum(v for k, v in first.items() if k != "device_total") == first["device_total"]
    assert _js(d, "return document.getElementById('verdict').dataset.fits;") == "true"
    assert int(_text(d, "max-batch")) > 8 and _text(d, "peak-phase") in ("forward", "backward", "optimizer")
    assert _charts_loaded(d) == ["memory"]
    assert _js(d, "return document.querySelectorAll('#table-time tbody td').length;") == 6
    assert "gpu=A100-80GB" in d.current_url and "config=" in d.current_url

    # Another batch: the answer follows, and the URL with it.
    _type(d, "f-estimate-per_device_train_batch_size", "16")
    _click(d, "#run")
    _until(lambda: "batch 16 x 1" in _text(d, "summary") and _js(d, "return document.getElementById('status').hidden;"),
           "the estimate at batch 16")
    second = _anatomy(d)
    assert second["device_total"] > first["device_total"] and second["weights"] == first["weights"]
    shared = d.current_url
    assert "per_device_train_batch_size=16" in shared

    # The shared link, opened anew, shows the same view.
    d.get("about:blank")
    _open(d, shared)
    _answered(d, "#verdict")
    assert _anatomy(d) == second
    assert d.find_element("id", "f-estimate-per_device_train_batch_size").get_attribute("value") == "16"
    assert _text(d, "f-config-name") == "config.json"
    assert _text(d, "command").startswith("anatomist estimate --gpu=A100-80GB --seq-len=64 --per-device-train-batch-size=16")

    # A plan over a small search: the Pareto front, the top pick and its reasons, its files downloaded.
    _click(d, "input[name=view][value=plan]")
    for box in ("#f-plan-optims input[value=adafactor]", "#f-plan-optims input[value=adamw_bnb_8bit]",
                "#f-plan-precisions input[value=bf16]", "#f-plan-no_compile"):
        _click(d, box)
    _type(d, "f-plan-global_batch_size", "16")
    _click(d, "#run")
    _answered(d, "#table-pareto")
    assert _js(d, "return document.querySelectorAll('#table-pareto tr.best').length;") == 1
    assert _js(d, "return document.querySelectorAll('#reasons li').length;") > 0
    assert sorted(_charts_loaded(d)) == ["memory", "throughput"]
    assert "view=plan" in d.current_url and "optims=adamw_torch_fused" in d.current_url

    _click(d, "button[data-target=deepspeed]")
    ds_file = _until(lambda: d.find_elements("css selector", "a[data-file='ds_config.json']"), "the DeepSpeed file", 30, d)
    assert ds_file
    ds_config = json.loads(_download(d, downloads, "ds_config.json").read_text())
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: its config cannot be loaded")
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(ds_config)
    assert ds.train_batch_size == 16
    assert ds.bfloat16_config.enabled if hasattr(ds, "bfloat16_config") else ds.bfloat16_enabled  # named so in newer DeepSpeed

    _click(d, "button[data-target=trainer]")
    _until(lambda: d.find_elements("css selector", "a[data-file='training_args.json']"), "the TrainingArguments file", 30, d)
    kwargs = json.loads(_download(d, downloads, "training_args.json").read_text())
    from transformers import TrainingArguments

    assert set(kwargs) <= set(TrainingArguments.__dataclass_fields__) and kwargs["bf16"] is True
    gpu_only = {"fp16", "bf16", "tf32", "torch_compile", "fsdp"}  # refused by TrainingArguments on a machine without a GPU
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             **{k: v for k, v in kwargs.items() if k not in gpu_only})
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
    assert args.optim.value == "adamw_torch_fused"

    shot = tmp_path / "page.png"
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 20_000


def test_bad_input_is_one_clear_line_on_the_page(browser: Any, live: LiveServer, tmp_path: Path) -> None:
    d = browser
    _open(d, live.url + "?view=estimate&model=no-such-model&gpu=T4")  # a link: the page runs it on load
    _until(lambda: not _js(d, "return document.getElementById('error').hidden;"), "the error")
    message = _text(d, "error")
    assert message.startswith("unknown model 'no-such-model': not a path, not in the catalog")
    assert "\n" not in message.strip() and "Traceback" not in message

    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64,')
    d.find_element("id", "f-config-file").send_keys(str(bad))
    _until(lambda: "not valid JSON" in _text(d, "error"), "the upload's error")
    assert _text(d, "error").startswith("config.json: not valid JSON (") and _text(d, "f-config-name") == ""


@pytest.mark.skipif(not os.environ.get("ANATOMIST_WEB_SCREENSHOT"), reason="set ANATOMIST_WEB_SCREENSHOT=PATH to save it")
def test_screenshot_for_the_readme(browser: Any, live: LiveServer) -> None:
    d = browser
    d.set_window_size(1280, 1700)
    _open(d, live.url + "?view=estimate&model=Llama-3.2-1B&gpu=RTX-4090&seq_len=1024&per_device_train_batch_size=4"
                        "&gradient_checkpointing=true&bf16=true")
    _answered(d, "#verdict")
    _charts_loaded(d)
    d.execute_script("document.activeElement.blur(); window.scrollTo(0, 0);")
    assert d.save_screenshot(os.environ["ANATOMIST_WEB_SCREENSHOT"])
