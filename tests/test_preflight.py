"""Pre-flight inside the real Trainer (issue 24), on this CPU with a tiny model and an explicit budget.

The budget is set between two predictions (the user's batch and a smaller one at the same effective
batch), so what is checked is the Trainer's behaviour, observed independently of anatomist: whether an
optimizer step ran (a hook on the optimizer), the batch the model was fed (a forward pre-hook), the
number of optimizer steps the Trainer took, and the record read back.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import TINY_CONFIGS

from anatomist.bench.worker import build_dataset
from anatomist.errors import InputError
from anatomist.estimate.predict import estimate
from anatomist.hardware import get_gpu
from anatomist.measure import AnatomistCallback
from anatomist.measure.preflight import PreflightRefused
from anatomist.measure.run_log import append_record, read_records
from anatomist.recipe import Recipe
from anatomist.workload_loader import load_workload

SEQ = 64
GPU = "A100-80GB"
BARE = dataclasses.replace(get_gpu(GPU), cuda_context_bytes=0)
"""The A100 without its CUDA context: a tiny model's recipes then differ by more than the memory interval's width
(the context, 1.35 GiB, would be most of each total), so a budget can refuse one and fit another."""
NUM_SAMPLES = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIGS["llama"]))
    return load_workload(str(folder), seq_len=SEQ, task="causal-lm")


def _total(workload, batch: int, accumulation: int) -> int:
    recipe = Recipe(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, dtype="float32")
    total = estimate(workload, recipe, BARE).memory.anatomy.device_total
    assert total is not None
    return total


def _trainer(workload, tmp_path, batch: int, accumulation: int, callback=None, **extra):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, num_train_epochs=1, report_to="none",
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True, **extra)
    model = workload.build_model("sdpa", "float32")
    return Trainer(model=model, args=args, train_dataset=build_dataset(workload, NUM_SAMPLES),
                   callbacks=[callback] if callback is not None else None)


def _feeds(model) -> list[int]:
    """The batch size of every forward the model runs (a hook: what the Trainer really fed)."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    return seen


@pytest.mark.slow
def test_refuse_stops_before_the_first_optimizer_step(llama, tmp_path):
    # budget just under the prediction at 16 x 1: 16 x 1 does not fit, a smaller pair does
    budget = (_total(llama, 16, 1) + _total(llama, 4, 4)) // 2
    callback = AnatomistCallback(tokens_per_sample=SEQ, preflight="refuse", gpu=BARE, limit_bytes=budget, record=False)
    trainer = _trainer(llama, tmp_path, 16, 1)
    trainer.add_callback(callback)  # added after __init__: the pre-flight runs at on_train_begin
    steps: list[int] = []
    trainer.create_optimizer()
    trainer.optimizer.register_step_pre_hook(lambda *a: steps.append(1))
    with pytest.raises(PreflightRefused, match=r"will not fit: predicted device total .* against the limit .*smallest "
                                               r"change that fits at the top of its interval: .*effective batch 16 kept"):
        trainer.train()
    assert steps == [] and trainer.state.global_step == 0
    change = callback.preflight.change.recipe
    assert change.per_device_train_batch_size * change.gradient_accumulation_steps == 16


@pytest.mark.slow
def test_fit_keeps_the_effective_batch_and_trains(llama, tmp_path):
    budget = (_total(llama, 16, 1) + _total(llama, 4, 4)) // 2
    trainer = _trainer(llama, tmp_path, 16, 1)
    fed = _feeds(trainer.model)
    callback = AnatomistCallback(tokens_per_sample=SEQ, preflight="fit", gpu=BARE, limit_bytes=budget,
                                 record=tmp_path / "runs.jsonl", compare_after_steps=1, print_at_end=False)
    callback.attach(trainer)
    new = callback.preflight.change.recipe
    assert new.per_device_train_batch_size < 16
    assert new.per_device_train_batch_size * new.gradient_accumulation_steps == 16
    trainer.train()
    # what the Trainer did: every forward got the new per-device batch; 32 samples / 16 = 2 optimizer steps
    assert set(fed) == {new.per_device_train_batch_size}
    assert len(fed) == NUM_SAMPLES // new.per_device_train_batch_size
    assert trainer.state.global_step == NUM_SAMPLES // 16
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 16
    # measured beside predicted went through the Trainer's own log (what TensorBoard / W&B / trackio receive)
    [logged] = [h for h in trainer.state.log_history if "anatomist/measured_median_step_s" in h]
    # the prediction of the pair it trains with, which fits the budget
    assert logged["anatomist/predicted_device_total"] == callback.watch.running.memory.anatomy.device_total <= budget
    assert logged["anatomist/measured_median_step_s"] > 0
    [row] = read_records(tmp_path / "runs.jsonl")
    assert row["recipe"]["per_device_train_batch_size"] == new.per_device_train_batch_size
    assert row["measured"]["time"]["median_step_s"] > 0 and row["predicted"]["memory"]["device_total"] > 0


@pytest.mark.slow
def test_fit_with_no_pair_that_fits_refuses_and_leaves_the_batch(llama, tmp_path):
    # below batch 1 x 16 (the smallest pair keeping 16), above the weights: no pair fits
    budget = _total(llama, 1, 16) - 2**20
    trainer = _trainer(llama, tmp_path, 16, 1)
    callback = AnatomistCallback(tokens_per_sample=SEQ, preflight="fit", gpu=BARE, limit_bytes=budget, record=False)
    with pytest.raises(PreflightRefused, match="will not fit"):
        callback.attach(trainer)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (16, 1)
    assert trainer._train_batch_size == 16


@pytest.mark.slow
def test_fit_without_attach_says_how(llama, tmp_path):
    budget = (_total(llama, 16, 1) + _total(llama, 4, 4)) // 2
    callback = AnatomistCallback(tokens_per_sample=SEQ, preflight="fit", gpu=BARE, limit_bytes=budget, record=False)
    trainer = _trainer(llama, tmp_path, 16, 1, callback)
    with pytest.raises(PreflightRefused, match=r"\.attach\(trainer\) before trainer\.train\(\)"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.slow
def test_warn_lets_a_run_that_does_not_fit_go_on(llama, tmp_path, caplog):
    budget = (_total(llama, 16, 1) + _total(llama, 4, 4)) // 2
    callback = AnatomistCallback(tokens_per_sample=SEQ, gpu=BARE, limit_bytes=budget, record=False, print_at_end=False)
    trainer = _trainer(llama, tmp_path, 16, 1, callback)
    with caplog.at_level("WARNING", logger="anatomist"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert "fits            no" in caplog.text and callback.preflight is not None and not callback.preflight.fits


def test_no_prediction_says_why_and_trains(llama, tmp_path, caplog):
    callback = AnatomistCallback(preflight="refuse", gpu=GPU, record=False, print_at_end=False)  # no tokens/sample
    trainer = _trainer(llama, tmp_path, 8, 1, callback)
    with caplog.at_level("WARNING", logger="anatomist"):
        trainer.train()
    assert trainer.state.global_step == 4
    assert "pre-flight skipped, the run goes on: tokens per sample unknown" in caplog.text


def test_bad_inputs_are_one_clear_message(llama, tmp_path):
    with pytest.raises(InputError, match="preflight must be one of warn, refuse, fit"):
        AnatomistCallback(preflight="maybe")
    weights = 4 * sum(p.numel() for p in llama.build_model("sdpa", "float32").parameters())  # fp32: 4 B each
    callback = AnatomistCallback(tokens_per_sample=SEQ, preflight="refuse", gpu=GPU, limit_bytes=weights // 2,
                                 record=False)
    with pytest.raises(InputError, match="is below .*'s weights alone"):
        _trainer(llama, tmp_path, 8, 1, callback)
    warned = AnatomistCallback(tokens_per_sample=SEQ, gpu=GPU, limit_bytes=weights // 2, record=False)
    _trainer(llama, tmp_path, 8, 1, warned)  # "warn" says it and lets the run go on
    assert "weights alone" in (warned.watch.skipped or "")


def test_a_broken_record_line_is_skipped(tmp_path, cli):
    missing = cli("calibrate", "--records", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    path = tmp_path / "runs.jsonl"
    good = {"name": "a", "status": "ok", "workload": {}, "recipe": {}, "device": {}}
    append_record(good, path)
    with path.open("a") as fh:
        fh.write('{"name": "torn", "sta')  # a run killed mid-line
    with pytest.warns(UserWarning, match=r"runs.jsonl:2: skipped"):
        rows = read_records(path)
    assert rows == [good]
    append_record(good, path)  # after the torn line: a line of its own, read back whole
    with pytest.warns(UserWarning, match=r"runs.jsonl:2: skipped"):
        assert read_records(path) == [good, good]


@pytest.mark.slow  # traces the LoRA model: 25-55 s on the shared 2-core VM
def test_sft_trainer_with_a_peft_model_fits(llama, tmp_path):
    """TRL's SFTTrainer wraps the model from a LoraConfig: the pre-flight reads the adapters (r=8) off the
    live model and the tokens per sample off SFTConfig.max_length, and "fit" keeps the effective batch."""
    from peft import LoraConfig
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from anatomist.measure.live import live_recipe

    vocab = {f"t{i}": i for i in range(TINY_CONFIGS["llama"]["vocab_size"])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        eos_token="t1", pad_token="t2", unk_token="t0")
    args = SFTConfig(output_dir=str(tmp_path / "out"), num_train_epochs=1, per_device_train_batch_size=16,
                     max_length=SEQ, gradient_checkpointing=False, bf16=False, use_cpu=True, report_to="none",
                     save_strategy="no", logging_strategy="no", disable_tqdm=True)
    dataset = build_dataset(llama, NUM_SAMPLES).remove_columns("labels").with_format(None)
    trainer = SFTTrainer(model=llama.build_model("sdpa", "float32"), args=args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=LoraConfig(r=8, task_type="CAUSAL_LM"))
    recipe, _ = live_recipe(trainer.args, trainer.model)
    gpu = get_gpu(GPU)
    totals = [estimate(llama, recipe.replace(per_device_train_batch_size=b, gradient_accumulation_steps=a), gpu)
              .memory.anatomy.device_total for b, a in ((16, 1), (4, 4))]
    fed = _feeds(trainer.model)
    callback = AnatomistCallback(preflight="fit", gpu=GPU, limit_bytes=sum(totals) // 2, record=False,
                                 print_at_end=False).attach(trainer)
    given = callback.preflight.estimate.recipe
    assert (given.peft, given.lora_r, given.dtype, callback.preflight.estimate.workload.seq_len) == \
        ("lora", 8, "float32", SEQ)
    new = callback.preflight.change.recipe
    assert new.per_device_train_batch_size < 16 and new.per_device_train_batch_size * new.gradient_accumulation_steps == 16
    trainer.train()
    assert set(fed) == {new.per_device_train_batch_size} and trainer.state.global_step == NUM_SAMPLES // 16


def _loop(workload, t, model, optimizer, batch: int, steps: int) -> None:
    data = build_dataset(workload, batch * steps)
    for i in range(steps):
        t.step_begin()
        rows = data[i * batch:(i + 1) * batch]
        model(input_ids=rows["input_ids"], labels=rows["labels"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t.step_end()


@pytest.mark.slow
def test_track_refuses_before_the_loop(llama):
    import torch

    from anatomist.measure import track

    budget = (_total(llama, 16, 1) + _total(llama, 4, 4)) // 2
    model = llama.build_model("sdpa", "float32")
    ran: list[int] = []
    with pytest.raises(PreflightRefused, match="smallest change that fits at the top of its interval: per_device_train_batch_size=16 -> "):
        with track(model, torch.optim.AdamW(model.parameters()), samples_per_step=16, tokens_per_sample=SEQ,
                   recipe={"per_device_train_batch_size": 16}, preflight="refuse", gpu=BARE, limit_bytes=budget,
                   record=False, print_at_end=False):
            ran.append(1)
    assert ran == []
    with pytest.raises(InputError, match="track\\(\\) cannot change your loop's batch"):
        with track(model, samples_per_step=16, preflight="fit"):
            pass


def test_a_run_record_is_read_by_calibrate(llama, tmp_path, cli):
    """A plain loop under track() keeps one record; `anatomist calibrate --records` reads it as a bench row
    (a CPU row cannot calibrate a GPU: it says so; the same row marked as run on an A100 is fitted)."""
    import torch

    from anatomist.measure import track

    model = llama.build_model("sdpa", "float32")
    optimizer = torch.optim.AdamW(model.parameters())
    records = tmp_path / "runs.jsonl"
    with track(model, optimizer, samples_per_step=4, tokens_per_sample=SEQ, recipe={"per_device_train_batch_size": 4},
               gpu=GPU, compare_after_steps=2, record=records, print_at_end=False, attribute_step=None) as t:
        _loop(llama, t, model, optimizer, 4, 3)
    assert t.preflight is not None and t.preflight.fits
    [row] = read_records(records)
    assert row["device"]["kind"] == "cpu" and row["recipe"]["per_device_train_batch_size"] == 4
    assert row["measured"]["time"]["median_step_s"] > 0
    assert row["predicted"]["memory"]["device_total"] == t.preflight.device_total_bytes
    on_cpu = cli("calibrate", "--records", str(records))
    assert on_cpu.returncode == 2 and "no finished GPU row" in on_cpu.stderr
    row["device"] = {"kind": "cuda", "name": "NVIDIA A100-SXM4-80GB", "memory_bytes": 85_899_345_920}
    records.write_text(json.dumps(row) + "\n")
    fitted = cli("calibrate", "--records", str(records), "--json")
    assert fitted.returncode == 0, fitted.stderr
    data = json.loads(fitted.stdout)
    assert data["gpu"] == "A100-80GB" and len(data["rows"]) == 1
    assert data["rows"][0]["measured_step_s"] == row["measured"]["time"]["median_step_s"]


def test_the_space_around_a_recipe_says_why_the_plan_cannot_search_it() -> None:
    """The smallest change is searched by the plan around the run's recipe; a sharding the plan does not search on that
    many devices (ZeRO-1 on one GPU) is named as such, not as its precision."""
    from anatomist.measure.preflight import search_space
    from anatomist.plan.space import SearchSpace

    gpu = get_gpu("A100-80GB")
    assert search_space(Recipe(zero_stage=1), 1, set(), gpu) == "its sharding (zero1) is not one the plan searches on 1 GPU(s)"
    around = search_space(Recipe(zero_stage=1, bf16=True), 2, {"optim"}, gpu)
    assert isinstance(around, SearchSpace) and around.shardings == ("zero1",) and around.num_gpus == 2
