"""Regenerate src/anatomist/data/recipe_fields.json: the field names of the argument classes that
training files have been written against, in releases of the last two years.

A TrainingArguments / SFTConfig / DPOConfig YAML written for an older release names fields the
installed one no longer has (`warmup_ratio`, `overwrite_output_dir`, `max_seq_length`): such a
field is a real field, left out of the prediction, never a typo. This script reads the classes'
field names from the released wheels (pip download --no-deps) and from the alignment handbook's
git history, with `ast` (nothing is imported), and writes them with the versions that have them.

    pip download --no-deps -d WHEELS transformers==4.46.3 ... trl==0.12.2 ...
    python scripts/historical_fields.py WHEELS HANDBOOK_GIT_DIR
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

CLASSES = ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "DPOConfig", "ORPOConfig", "ModelConfig",
           "ScriptArguments", "DatasetMixtureConfig", "ModelArguments", "DataArguments")
HANDBOOK_COMMITS = ("95dc472", "19f0345")
"""huggingface/alignment-handbook src/alignment/configs.py: before and after the move to TRL's parsers."""
OUT = Path(__file__).resolve().parents[1] / "src/anatomist/data/recipe_fields.json"


def fields_in(source: str) -> dict[str, set[str]]:
    """Annotated class attributes of each class in CLASSES defined in `source`."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            found.setdefault(node.name, set()).update(n for n in names if not n.startswith("_"))
    return found


def main(wheels: Path, handbook: Path) -> None:
    table: dict[str, dict[str, list[str]]] = {}

    def add(tool: str, found: dict[str, set[str]]) -> None:
        for cls, names in found.items():
            for name in names:
                table.setdefault(cls, {}).setdefault(name, []).append(tool)

    for wheel in sorted(wheels.glob("*.whl")):
        package, version = wheel.name.split("-")[:2]
        found: dict[str, set[str]] = {}
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.endswith(".py") and ("training_args" in name or "config" in name or "utils" in name):
                    for cls, names in fields_in(archive.read(name).decode()).items():
                        found.setdefault(cls, set()).update(names)
        add(f"{package} {version}", found)
    for commit in HANDBOOK_COMMITS:
        source = subprocess.run(["git", "-C", str(handbook), "show", f"{commit}:src/alignment/configs.py"],
                                check=True, capture_output=True, text=True).stdout
        add(f"alignment-handbook {commit}", fields_in(source))
    data = {"_source": "scripts/historical_fields.py: " + ", ".join(
        sorted({w.name.removesuffix("-py3-none-any.whl") for w in wheels.glob("*.whl")}))
        + ", huggingface/alignment-handbook " + " ".join(HANDBOOK_COMMITS),
        **{cls: {name: sorted(v) for name, v in sorted(names.items())} for cls, names in sorted(table.items())}}
    OUT.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
