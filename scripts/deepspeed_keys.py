"""Regenerate src/anatomist/data/deepspeed_keys.json: the keys a ds_config may hold, and the bounds DeepSpeed puts on
its numbers (anatomist.deepspeed_bounds reads them where deepspeed is not installed), from the installed deepspeed.

DeepSpeed validates its sections with pydantic models that forbid extra keys (deepspeed/runtime/
config_utils.py DeepSpeedConfigModel: extra="forbid"): zero_optimization, its offload_param /
offload_optimizer, bf16 and fp16. Its top level is read key by key (runtime/config.py
get_*(param_dict)) with the names in the constants modules; those names are collected here.

    python scripts/deepspeed_keys.py
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import deepspeed
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

from anatomist.deepspeed_bounds import read_models

READ_IN_LOOPS = ("tensorboard", "wandb", "csv_monitor", "comet", "amp")
"""Top-level keys read through a loop or a dict literal, which the scan below does not see: monitor/config.py
`for key in ("tensorboard", "wandb", "csv_monitor", "comet")`, runtime/config.py's "amp" section."""
OUT = Path(__file__).resolve().parents[1] / "src/anatomist/data/deepspeed_keys.json"
SECTIONS = {"zero_optimization": DeepSpeedZeroConfig, "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
            "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig, "bf16": DeepSpeedBF16Config,
            "bfloat16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config}


def model_keys(model: type) -> list[str]:
    """A pydantic model's field names and their aliases (DeepSpeed accepts both: populate_by_name)."""
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return sorted(names)


def top_level_keys(root: Path) -> list[str]:
    """A superset of the top-level keys: the string values of DeepSpeed's upper-case constants (runtime/constants.py
    and the like), and the literal keys its config readers look up (`param_dict.get("tensorboard", {})`)."""
    keys = set(READ_IN_LOOPS)
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.isupper()):
                value = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and _dict_name(node.func.value) and node.args:
                value = node.args[0]
            elif isinstance(node, ast.Subscript) and _dict_name(node.value):
                value = node.slice
            else:
                continue
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.isidentifier():
                keys.add(value.value)
    return sorted(keys)


def _dict_name(node: ast.expr) -> bool:
    """The config dictionaries DeepSpeed's readers take: param_dict, ds_config, config_dict."""
    return isinstance(node, ast.Name) and node.id in ("param_dict", "ds_config", "config_dict", "pd")


def main() -> None:
    root = Path(deepspeed.__file__).parent
    data = {"_source": f"scripts/deepspeed_keys.py, deepspeed {deepspeed.__version__}",
            "top_level": top_level_keys(root), **{name: model_keys(model) for name, model in SECTIONS.items()},
            "bounds": read_models({name: model for name, model in SECTIONS.items() if name != "bfloat16"})}
    OUT.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
