"""Trace a few parts of tiny models in this fresh interpreter and print what of the anatomist
package they loaded: the modules imported and the files opened (an audit hook sees every open).

Usage: python trace_loads.py LLAMA_CONFIG_DIR T5_CONFIG_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

opened: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str):
        opened.append(args[0])


sys.addaudithook(_audit)

import anatomist  # noqa: E402
from anatomist.recipe import Recipe  # noqa: E402
from anatomist.trace.depth.plan import model_plan  # noqa: E402
from anatomist.trace.store.parts import trace_part  # noqa: E402
from anatomist.workload_loader import load_workload  # noqa: E402

RECIPES = [  # between them: fp16 (GradScaler), checkpointing, accumulation, a low-bit optimizer's layout, QLoRA
    Recipe(per_device_train_batch_size=2, fp16=True, dtype="float32", gradient_checkpointing=True,
           optim="adamw_bnb_8bit", gradient_accumulation_steps=2),
    Recipe.with_presets(peft="qlora", per_device_train_batch_size=2, optim="adafactor", attn_implementation="eager"),
]


def main(llama: str, t5: str) -> None:
    for folder, recipes, parts in ((llama, RECIPES, ("forward-backward", "optimizer", "inference")),
                                   (t5, RECIPES[:1], ("forward-backward",))):
        workload = load_workload(folder, seq_len=16)
        for recipe in recipes:
            resolved = recipe.resolved(workload)
            plan = model_plan(workload, resolved).plan
            for part in parts:
                trace_part(workload, resolved, part, depth=plan.base, batch_size=2, compute_capability="9.0")
    root = Path(anatomist.__file__).resolve().parent
    modules = {Path(m.__file__).resolve() for name, m in list(sys.modules.items())
               if name.split(".")[0] == "anatomist" and getattr(m, "__file__", None)}
    files = {Path(f).resolve() for f in opened} | modules
    print(json.dumps(sorted(str(f.relative_to(root)) for f in files
                            if f.is_relative_to(root) and f.is_file() and "__pycache__" not in f.parts)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
