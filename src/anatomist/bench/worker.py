"""Run ONE bench row in this (fresh) process and write its result row as JSON.

    python -m anatomist.bench.worker SPEC.json ROW.json

The parent (`runner.py`) starts one worker per row, as the seeds advise restarting between
experiments: memory and CUDA state from one row cannot leak into the next. The row is run
the way a user runs it: a real `datasets.Dataset` of random token ids (100..30000) and
binary labels through `transformers.Trainer` (or a plain Accelerate loop), measured by
`AnatomistCallback` / `track()`, then compared with the estimator's prediction.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from anatomist.errors import InputError
from anatomist.measure.monitor import cuda_available, device_info, versions
from anatomist.measure.recorder import RunSummary, mfu_inputs
from anatomist.recipe import Recipe, ResolvedRecipe
from anatomist.recipe.spellings import training_arguments, training_arguments_kwargs
from anatomist.workload import Workload
from anatomist.workload_loader import load_workload

CPU_REFERENCE_GPU = "A100-80GB"
"""The catalog GPU whose code paths the CPU prediction uses (any Ampere part would do)."""


def build_dataset(workload: Workload, num_samples: int) -> Any:
    """The seeds' dataset: random token ids in [100, 30000), binary labels; for a language model
    the labels are the ids themselves (the model shifts them)."""
    import datasets

    gen = torch.Generator().manual_seed(0)
    high = min(30000, int(workload.config.vocab_size))
    ids = torch.randint(min(100, high - 1), high, (num_samples, workload.seq_len), generator=gen)
    if workload.task == "causal-lm":
        labels = ids.tolist()
    else:
        labels = torch.randint(0, 2, (num_samples,), generator=gen).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels})
    return ds.with_format("torch")


def training_model(workload: Workload, recipe: ResolvedRecipe, folder: str | None = None) -> Any:
    """The model as a user of `recipe` makes it: a quantized base is loaded through
    `from_pretrained(quantization_config=BitsAndBytesConfig(...))` (bitsandbytes quantizes at
    load, so the random weights are saved to `folder` first) and prepared with
    `prepare_model_for_kbit_training`; LoRA adapters come from `get_peft_model`."""
    from anatomist.recipe.spellings import bnb_config, lora_config
    from anatomist.trace.step.experts import build_kwargs

    model = workload.build_model(recipe.attn_implementation, recipe.dtype, **build_kwargs(workload, recipe))
    quantization = bnb_config(recipe)
    if quantization is not None:
        if folder is None:
            raise ValueError("a quantized base is loaded from a folder: pass one")
        import transformers
        from peft import prepare_model_for_kbit_training

        model.save_pretrained(folder)
        model = type(model).from_pretrained(
            folder, quantization_config=transformers.BitsAndBytesConfig(**quantization),
            dtype=model.dtype, attn_implementation=recipe.attn_implementation,
        )
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing)
    adapters = lora_config(recipe, workload.task)
    if adapters is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**adapters))
    return model


def enable_checkpointing(model: Any, recipe: ResolvedRecipe) -> None:
    """Gradient checkpointing as the Trainer turns it on before `accelerator.prepare` (a quantized base
    has it from `prepare_model_for_kbit_training` already)."""
    if recipe.gradient_checkpointing and not recipe.quantized:
        # every_n_layers / offload where the recipe sets them (spellings.training_arguments_kwargs)
        settings = training_arguments_kwargs(recipe).get("gradient_checkpointing_kwargs", {})
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)(**settings)
        if recipe.peft != "none":
            model.enable_input_require_grads()  # as the Trainer does for adapters over a frozen embedding


def optimizer_class(recipe: ResolvedRecipe) -> tuple[type, dict[str, Any]]:
    """The optimizer class and keyword arguments the Trainer builds for the recipe's `optim`."""
    from transformers import Trainer

    with tempfile.TemporaryDirectory(prefix="anatomist-args-") as out_dir:  # nothing is written there
        args = training_arguments(recipe, out_dir, report_to="none", use_cpu=not cuda_available())
        return Trainer.get_optimizer_cls_and_kwargs(args)


def run_trainer(workload: Workload, recipe: ResolvedRecipe, ds: Any, epochs: float, out_dir: str) -> tuple[RunSummary, dict[str, Any]]:
    from transformers import Trainer

    from anatomist.measure.callback import AnatomistCallback

    model = training_model(workload, recipe, str(Path(out_dir) / "base"))
    flops, peak = mfu_inputs(workload, recipe)
    callback = AnatomistCallback(tokens_per_sample=workload.seq_len, print_at_end=False, flops=flops, peak_flops=peak)
    args = training_arguments(
        recipe, out_dir, num_train_epochs=epochs, report_to="none", logging_strategy="no", save_strategy="no",
        disable_tqdm=True, use_cpu=not cuda_available(),
    )
    result = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback]).train()
    assert callback.summary is not None
    return callback.summary, dict(result.metrics)


def run_accelerate(workload: Workload, recipe: ResolvedRecipe, ds: Any, epochs: float, out_dir: str) -> tuple[RunSummary, dict[str, Any]]:
    """The seeds' "Using Accelerate" loop: Accelerator + the recipe's optimizer, by hand."""
    import time

    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from anatomist.measure.track import track

    # TrainingArguments resets accelerate's shared state: build them before the Accelerator.
    cls, kwargs = optimizer_class(recipe)
    accelerator = Accelerator(mixed_precision=recipe.mixed_precision,
                              gradient_accumulation_steps=recipe.gradient_accumulation_steps, cpu=not cuda_available())
    model = training_model(workload, recipe, str(Path(out_dir) / "base"))
    enable_checkpointing(model, recipe)
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    loader = DataLoader(ds, batch_size=recipe.per_device_train_batch_size, shuffle=True,
                        num_workers=recipe.dataloader_num_workers, pin_memory=recipe.dataloader_pin_memory and cuda_available())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    samples_per_step = recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps
    start = time.perf_counter()
    flops, peak = mfu_inputs(workload, recipe)
    with track(accelerator.unwrap_model(model), optimizer, samples_per_step=samples_per_step,
               tokens_per_sample=workload.seq_len, mixed_precision=recipe.mixed_precision, print_at_end=False,
               flops=flops, peak_flops=peak) as t:
        for _epoch in range(max(1, round(epochs))):
            for index, batch in enumerate(loader):
                if index % recipe.gradient_accumulation_steps == 0:
                    t.step_begin()
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        t.before_optimizer_step()
                        if recipe.max_grad_norm > 0:
                            accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:
                    t.step_end()
    runtime = time.perf_counter() - start
    assert t.summary is not None
    return t.summary, {"train_runtime": runtime, "train_samples_per_second": len(ds) * epochs / runtime}


def predict(workload: Workload, recipe: ResolvedRecipe, *, num_gpus: int = 1) -> tuple[dict[str, Any], list[str]]:
    """The estimator's prediction for this row on this device (per device of `num_gpus`), and notes on how
    it was made."""
    from anatomist.estimate.memory import estimate_memory
    from anatomist.estimate.time.device import estimate_time
    from anatomist.hardware import cublas_workspace_bytes, detect_local_gpu, get_gpu

    notes: list[str] = []
    gpu = detect_local_gpu() if cuda_available() else None
    if cuda_available() and gpu is None:
        return {"memory": {}, "time": {}}, ["this GPU is not in the catalog: no prediction"]
    on_cpu = gpu is None
    if gpu is None:
        gpu = get_gpu(CPU_REFERENCE_GPU)
    anatomy = estimate_memory(workload, recipe, gpu, num_gpus=num_gpus).anatomy
    if on_cpu:
        # The tensor categories only: CPU has no cuBLAS workspace, no reserve, no context.
        # Two workspaces live through a training step (the main thread's and autograd's: trace/step/driver.py); the
        # rest of functionality is the step's own (DDP's gradient buckets, FSDP's collective buffers).
        live_workspaces = 2 * cublas_workspace_bytes(gpu.compute_capability)
        anatomy = dataclasses.replace(
            anatomy, functionality=anatomy.functionality - live_workspaces,
            peak_allocated=anatomy.peak_allocated - live_workspaces,
            runtime_overhead=None, peak_reserved=None, device_total=None,
        )
        notes.append(f"CPU: predicted with {CPU_REFERENCE_GPU}'s code paths, tensor categories only "
                     "(cuBLAS workspaces removed; reserved/device total have no CPU analogue)")
    memory = anatomy.to_dict()
    time_pred = estimate_time(workload, recipe, gpu).to_dict() if not on_cpu and num_gpus == 1 else {}
    if num_gpus > 1:
        notes.append(f"predicted per process of {num_gpus} (estimate_memory num_gpus={num_gpus}); no time prediction "
                     "for several processes")
    return {"memory": memory, "time": time_pred}, notes


def error_pct(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float | None]:
    """(predicted - measured) / measured x 100 per figure; None where either side is missing."""

    def pct(m: float | None, p: float | None) -> float | None:
        if m is None or p is None or m == 0:
            return None
        return round((p - m) / m * 100, 2)

    mm, pm = measured.get("memory") or {}, predicted.get("memory") or {}
    out = {k: pct(mm.get(k), pm.get(k)) for k in ("peak_allocated", "peak_reserved", "device_total")}
    out["samples_per_second"] = pct(measured.get("samples_per_second"), (predicted.get("time") or {}).get("samples_per_second"))
    return out


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    recipe = Recipe.from_dict(spec["recipe"])
    row: dict[str, Any] = {
        "suite": spec["suite"], "name": spec["name"], "model": spec["model_label"], "recipe": recipe.to_dict(),
        "workload": {"model": spec["model"], "model_config": spec.get("model_config"), "seq_len": spec["seq_len"],
                     "task": spec.get("task", "sequence-classification")},
        "loop": spec["loop"], "device": device_info(), "versions": versions(), "status": "ok", "reason": None,
        "measured": {}, "predicted": {}, "error_pct": {}, "notes": [],
    }
    with tempfile.TemporaryDirectory(prefix="anatomist-bench-") as tmp:
        model = spec["model"]
        if spec.get("model_config"):
            (Path(tmp) / "config.json").write_text(json.dumps(spec["model_config"]))
            model = tmp
        workload = load_workload(model, seq_len=spec["seq_len"], task=spec.get("task", "sequence-classification"))
        resolved = recipe.resolved(workload)
        ds = build_dataset(workload, spec["num_samples"])
        runner = run_accelerate if spec["loop"] == "accelerate" else run_trainer
        try:
            summary, metrics = runner(workload, resolved, ds, spec["num_train_epochs"], str(Path(tmp) / "out"))
        except torch.cuda.OutOfMemoryError as exc:
            row.update(status="oom", reason=f"CUDA out of memory: {str(exc).splitlines()[0]}")
            summary = None
        if summary is not None:
            row["measured"] = {
                "train_runtime_s": float(metrics["train_runtime"]),
                "samples_per_second": summary.samples_per_second,
                "tokens_per_second": summary.tokens_per_second,
                "trainer_samples_per_second": float(metrics["train_samples_per_second"]),
                "memory": summary.memory.to_dict() if summary.memory is not None else None,
                "time": {"median_step_s": summary.median_step_s, "steps": summary.steps,
                         "mfu": summary.mfu, "hfu": summary.hfu},  # None without a catalogued GPU
                "device_memory": summary.device, "allocator": summary.allocator,
                "cuda_context_bytes": summary.cuda_context_bytes,
            }
        row["predicted"], notes = predict(workload, resolved)
        row["notes"].extend(notes)
    row["error_pct"] = error_pct(row["measured"], row["predicted"])
    return row


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    try:
        row = run_row(spec)
    except InputError as exc:
        row = {"status": "error", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a crash is a recorded result, not the end of the suite
        traceback.print_exc()
        row = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    out_path.write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
