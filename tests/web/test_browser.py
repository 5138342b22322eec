"""The page in headless Chromium, as a user drives it: the short form (each of its questions once) and its
answer, the shared link and an older one, a bad value, a phone's width; the plan form (each option once) and a
plan labelled by what differs, its files loaded by the real libraries; bad input said in one line.

Needs the Debian packages chromium and chromium-driver (scripts/install_browser.sh) and selenium (the
`dev` extra); without them the test skips and says why. With ANATOMIST_WEB_SCREENSHOT=DIR it also
saves the docs' screenshots of an estimate, a plan and a phone's view of catalog models into DIR.
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


def _select(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(value)


def _question_labels(driver: Any) -> list[str]:
    return _js(driver, "return Array.from(document.querySelectorAll('#question .field:not([hidden]) > label'))"
                       ".map(l => l.innerText.trim());")


@pytest.mark.slow
def test_the_short_form_answers_and_its_link_keeps_it(browser: Any, live: LiveServer, tiny_config: Path) -> None:
    """The question a newcomer answers first (model, GPU, method, trainer, length, batch, GPUs, nodes), each once:
    the answer, its words, its chart, the link (a fresh load and an older link's keys), the page at a phone's width."""
    d = browser
    d.set_window_size(1280, 1500)
    _open(d, live.url)
    assert _question_labels(d) == ["Model", "or upload its config.json", "GPU", "Method", "Trainer", "Sequence length",
                                   "Batch per GPU", "GPUs per node", "Nodes"]
    assert not _js(d, "return document.getElementById('advanced').open;")  # every other option folded away
    assert _js(d, "return document.querySelector('#question .field[data-field=per_device_train_batch_size]').title;") \
        .startswith("per_device_train_batch_size (--per-device-train-batch-size): Samples per forward/backward pass")
    d.find_element("id", "f-config-file").send_keys(str(tiny_config))
    _until(lambda: _text(d, "f-config-name") == "config.json", "the upload")
    _type(d, "f-gpu", "A100-80GB")
    _select(d, "f-estimate-peft", "lora")
    _select(d, "f-trainer", "sft")
    _type(d, "f-seq_len", "64")
    _type(d, "f-estimate-per_device_train_batch_size", "4")
    _type(d, "f-gpus", "2")
    _type(d, "f-nodes", "1")
    _click(d, "#run")
    _answered(d, "#verdict")
    summary = _text(d, "summary")
    assert summary.startswith("uploaded llama config.json (causal-lm, ") and "batch 4 x 1" in summary
    assert ", lora (r=16)" in summary and "on 2 x A100-80GB" in summary
    assert _js(d, "return document.getElementById('verdict').dataset.verdict;") == "fits"
    assert " (likely " in _text(d, "verdict")  # the device total's range, from the published runs' errors
    assert _text(d, "interval").startswith("Memory interval: not validated: no published GPU run of plain data")
    assert ", likely " in _js(d, "return document.querySelector('#table-time td[data-key=step_s]').innerText;")
    assert _text(d, "time-interval").startswith("Time interval: not validated: ")  # LoRA on 2 GPUs: no timed run
    assert int(_text(d, "max-batch")) > 4
    anatomy = _anatomy(d)
    assert sum(v for k, v in anatomy.items() if k != "device_total") == anatomy["device_total"]
    rows = _js(d, "return Array.from(document.querySelectorAll('#table-anatomy tbody td:first-child')).map(t => t.innerText.trim());")
    assert "feature buffers" in rows and not any("functionality" in r or "_" in r for r in rows)
    assert _js(d, "return document.querySelector('#table-anatomy thead th:nth-child(4)').innerText;") == "bytes/param rule"
    assert 'guide "Model training anatomy"' in _js(d, "return document.querySelector('.rule-note').innerText;")
    assert _charts_loaded(d) == ["memory"]
    command = _text(d, "command")
    assert command == ("anatomist estimate --gpu=A100-80GB --peft=lora --trainer=sft --seq-len=64 "
                       "--per-device-train-batch-size=4 --gpus=2 --nodes=1 config.json")
    shared = d.current_url
    assert "peft=lora" in shared and "trainer=sft" in shared and "gpus=2" in shared

    # the link, opened anew, shows the same answer, its fields filled
    d.get("about:blank")
    _open(d, shared)
    _answered(d, "#verdict")
    assert _anatomy(d) == anatomy and _text(d, "command") == command
    assert d.find_element("id", "f-estimate-peft").get_attribute("value") == "lora"

    # a link written before the page asked its question first: its keys are the same, an advanced one is shown
    config_id = shared.split("config=")[1].split("&")[0]
    _open(d, f"{live.url}?view=estimate&config={config_id}&gpu=A100-80GB&seq_len=64"
             "&per_device_train_batch_size=16&gradient_checkpointing=true")
    _answered(d, "#verdict")
    assert "batch 16 x 1" in _text(d, "summary")
    assert _js(d, "return document.getElementById('advanced').open && "
                  "document.getElementById('f-estimate-gradient_checkpointing').closest('details.group').open;")

    # a value past its limit: one line naming the field and the limit, the field pointed at
    _type(d, "f-estimate-per_device_train_batch_size", "100000000000000000000")
    _click(d, "#run")
    _until(lambda: not _js(d, "return document.getElementById('error').hidden;"), "the error")
    assert _text(d, "error") == ("Batch per GPU (per_device_train_batch_size) must be at most 2^31 - 1 = 2,147,483,647, "
                                 "got 100000000000000000000")
    assert _js(d, "return document.querySelector('.field[data-field=per_device_train_batch_size]:not([hidden])')"
                  ".classList.contains('invalid');")

    # a phone's width: one column, nothing wider than the screen (tables scroll inside their box)
    _open(d, shared)
    _answered(d, "#verdict")
    d.set_window_size(390, 900)
    time.sleep(0.3)
    width, inner = _js(d, "return [document.documentElement.scrollWidth, window.innerWidth];")
    assert width <= inner
    d.set_window_size(1280, 1500)


def _fill_every_field(driver: Any, view: str) -> dict[str, str]:
    """Give every field of `view` but the uploads a value through the page's own inputs (a choice: its last; a
    set of choices: one more than its default; a number: its minimum or 2): the values set, by field."""
    return _js(driver, """
        const view = arguments[0], set = {};
        for (const f of state.schema.fields.filter((f) => f.views.includes(view) && f.kind !== "upload")) {
          const input = document.getElementById(fieldId(f));
          if (f.kind === "flag") { input.checked = true; set[f.name] = "true"; continue; }
          if (f.kind === "bool") { input.value = "true"; set[f.name] = "true"; continue; }
          if (f.kind === "choice") { input.value = String(f.choices[f.choices.length - 1]); set[f.name] = input.value; continue; }
          if (f.kind === "multi") {
            const boxes = Array.from(input.querySelectorAll("input"));
            const box = boxes.find((b) => !b.checked);
            box.checked = true;
            set[f.name] = boxes.filter((b) => b.checked).map((b) => b.value).join(",");
            continue;
          }
          const value = {model: "gpt2", gpu: "T4", lora_target_modules: "c_attn", memory_margin: "0.2",
                         lora_dropout: "0.05", seq_len: "128", avg_seq_len: "100", prompt_len: "16"}[f.name]
                        ?? (f.kind === "int" ? String(Math.max(f.minimum ?? 2, 2)) : "x");
          input.value = value;
          set[f.name] = value;
        }
        return set;""", view)


def test_the_plan_form_passes_every_option_of_anatomist_plan(browser: Any, live: LiveServer) -> None:
    """Each option of the plan view, set once through the page, reaches its flag: the page's query, read by the
    server's checks, becomes the command line `anatomist plan` parses back to the same values."""
    from anatomist.cli import build_parser
    from anatomist.web import service
    from anatomist.web.form import flags, parse

    d = browser
    _open(d, live.url)
    _click(d, "input[name=view][value=plan]")
    assert _question_labels(d) == ["Model", "or upload its config.json", "GPU", "Methods: full fine-tuning, and also",
                                   "Trainer", "Sequence length", "Global batch", "GPUs per node", "Nodes"]
    given = _fill_every_field(d, "plan")
    query = _js(d, "return readForm();")
    assert {k: v for k, v in query.items() if k != "view"} == given
    argv = flags(parse(query, service.fields()), service.fields())
    args = build_parser().parse_args(["plan", *argv, "--", "gpt2"])
    for field in service.fields():
        if "plan" not in field.views or field.flag is None:
            continue
        value = getattr(args, field.flag.removeprefix("--").replace("-", "_"))
        expected = {"flag": True, "int": int(given[field.name]) if field.kind == "int" else None,
                    "float": float(given[field.name]) if field.kind == "float" else None}.get(field.kind, given[field.name])
        assert value == expected, (field.name, value, expected)


@pytest.mark.slow
def test_a_plan_on_the_page_labels_its_recipes_by_what_differs(browser: Any, live: LiveServer, tiny_config: Path,
                                                                downloads: Path, tmp_path: Path) -> None:
    d = browser
    d.set_window_size(1280, 1500)
    _open(d, live.url + "?view=plan")
    d.find_element("id", "f-config-file").send_keys(str(tiny_config))
    _until(lambda: _text(d, "f-config-name") == "config.json", "the upload")
    _type(d, "f-gpu", "A100-80GB")
    _type(d, "f-seq_len", "64")
    _type(d, "f-plan-global_batch_size", "16")
    _click(d, "#advanced > summary")
    _click(d, "details.group[data-group='what the plan searches'] > summary")
    for box in ("#f-plan-optims input[value=adafactor]", "#f-plan-optims input[value=adamw_bnb_8bit]",
                "#f-plan-precisions input[value=bf16]", "#f-plan-no_compile"):
        _click(d, box)
    _click(d, "#run")
    _answered(d, "#table-pareto")
    assert _js(d, "return document.querySelectorAll('#table-pareto tr.best').length;") == 1
    labels = _js(d, "return Array.from(document.querySelectorAll('#table-pareto tbody tr')).map(r => r.dataset.label);")
    assert len(set(labels)) == len(labels)  # what differs names each recipe apart
    headers = _js(d, "return Array.from(document.querySelectorAll('#table-pareto thead th[data-key]')).map(t => t.dataset.key);")
    assert headers[0] == "batch"
    pick = _text(d, "pick-summary")
    assert "Liger Kernel " in pick and "batch " in pick  # the pick says Liger whether it differs or not
    assert "Liger Kernel" in _text(d, "shared") or "liger" in headers
    assert sorted(_charts_loaded(d)) == ["memory", "throughput"]
    assert "view=plan" in d.current_url and "optims=adamw_torch_fused" in d.current_url

    _click(d, "button[data-target=deepspeed]")
    _until(lambda: d.find_elements("css selector", "a[data-file='ds_config.json']"), "the DeepSpeed file", 30, d)
    ds_config = json.loads(_download(d, downloads, "ds_config.json").read_text())
    _click(d, "button[data-target=trainer]")
    _until(lambda: d.find_elements("css selector", "a[data-file='training_args.json']"), "the TrainingArguments file", 30, d)
    kwargs = json.loads(_download(d, downloads, "training_args.json").read_text())
    if "deepspeed" in kwargs:  # under ZeRO: the ds_config it names is offered beside it
        assert d.find_elements("css selector", f"a[data-file='{kwargs.pop('deepspeed')}']")
    from transformers import TrainingArguments

    assert set(kwargs) <= set(TrainingArguments.__dataclass_fields__) and kwargs["bf16"] is True
    gpu_only = {"fp16", "bf16", "tf32", "torch_compile", "fsdp", "use_liger_kernel"}  # refused on a machine without a GPU
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             **{k: v for k, v in kwargs.items() if k not in gpu_only})
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: its config cannot be loaded")
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(ds_config)
    assert ds.train_batch_size == 16


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


@pytest.mark.skipif(not os.environ.get("ANATOMIST_WEB_SCREENSHOT"), reason="set ANATOMIST_WEB_SCREENSHOT=DIR to save them")
def test_screenshots_for_the_docs(browser: Any, live: LiveServer) -> None:
    """DIR/web-screenshot.png (an estimate), DIR/web-plan-screenshot.png (a plan), DIR/web-phone-screenshot.png."""
    folder = Path(os.environ["ANATOMIST_WEB_SCREENSHOT"])
    d = browser
    shots = [("web-screenshot.png", 1280, "?view=estimate&model=Llama-3.2-1B&gpu=RTX-4090&seq_len=2048"
              "&per_device_train_batch_size=2&gradient_checkpointing=true&bf16=true", "#verdict"),
             ("web-plan-screenshot.png", 1280, "?view=plan&model=Llama-3.2-1B&gpu=RTX-4090&seq_len=2048"
              "&global_batch_size=16", "#table-pareto"),
             ("web-phone-screenshot.png", 390, "?view=estimate&model=Llama-3.2-1B&gpu=RTX-4090&seq_len=2048"
              "&per_device_train_batch_size=2&peft=lora", "#verdict")]
    for name, width, query, selector in shots:
        d.set_window_size(width, 1000)
        _open(d, live.url + query)
        _answered(d, selector)
        _charts_loaded(d)
        d.execute_script("document.activeElement.blur(); window.scrollTo(0, 0);")
        d.set_window_size(width, min(_js(d, "return document.documentElement.scrollHeight;") + 40, 4000))
        time.sleep(0.5)
        assert d.save_screenshot(str(folder / name))
