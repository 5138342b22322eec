"""Regenerate src/anatomist/data/framework_fields.json: the config keys axolotl and LLaMA-Factory accept.

Neither is a dependency: their YAMLs are read as YAML. Their schemas are read here from a git
checkout with `ast` (nothing is imported):
- axolotl: the pydantic models of src/axolotl/utils/schemas/*.py (AxolotlInputConfig and the
  mixins it inherits) and the plugins' args (src/axolotl/integrations/*/args.py: liger_*, ...);
- LLaMA-Factory: the dataclasses of src/llamafactory/hparams/*.py (ModelArguments, DataArguments,
  FinetuningArguments, its TrainingArguments over transformers' Seq2SeqTrainingArguments, ...).

    python scripts/framework_fields.py AXOLOTL_GIT_DIR LLAMA_FACTORY_GIT_DIR
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src/anatomist/data/framework_fields.json"
REPOS = {"axolotl": "axolotl-ai-cloud/axolotl", "LLaMA-Factory": "hiyouga/LLaMA-Factory"}
SOURCES = {"axolotl": ("src/axolotl/utils/schemas/", "src/axolotl/integrations/"),
           "LLaMA-Factory": ("src/llamafactory/hparams/",)}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def class_fields(source: str) -> set[str]:
    """Annotated attributes of every class in `source` (pydantic fields and dataclass fields alike), and the aliases
    their Field(...) gives them (axolotl's `type_of_model: ... = Field(alias="model_type")`)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            if not statement.target.id.startswith("_") and statement.target.id != "model_config":
                names.add(statement.target.id)
            if isinstance(statement.value, ast.Call):
                for keyword in statement.value.keywords:
                    if keyword.arg in ("alias", "validation_alias") and isinstance(keyword.value, ast.Constant):
                        names.add(keyword.value.value)
    return names


def main(axolotl: Path, llamafactory: Path) -> None:
    data: dict[str, object] = {}
    for tool, repo in (("axolotl", axolotl), ("LLaMA-Factory", llamafactory)):
        commit = git(repo, "rev-parse", "HEAD").strip()
        names: set[str] = set()
        for path in git(repo, "ls-tree", "-r", "--name-only", "HEAD").split():
            if path.endswith(".py") and path.startswith(SOURCES[tool]) and (
                    tool != "axolotl" or "schemas/" in path or path.endswith("args.py")):
                names |= class_fields(git(repo, "show", f"HEAD:{path}"))
        data[tool] = {"_source": f"github.com/{REPOS[tool]} {commit}: " + ", ".join(SOURCES[tool]), "fields": sorted(names)}
    OUT.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
