"""The page's fields, checked, and the command line they mean.

The page's state is its URL query (`?view=estimate&model=gpt2&gpu=A100-80GB&per_device_train_batch_size=16`):
one key per field, named as the CLI flag's destination (a Recipe field's name, `seq_len`, `gpu`),
so a link reproduces the view and reads like the command. `parse` checks every key and value
against the fields `fields.fields()` describes (generated from the Recipe dataclass and the
plan's options); `estimate_request` and `plan_request` make of them the request the CLI makes of its
flags (`cli.requests`), which the same functions answer; `flags` writes the command line a user would
type for the same answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from anatomist.anatomy import DEFAULT_MEMORY_MARGIN
from anatomist.axes.optimizers import DEFAULT_SEARCH
from anatomist.cli.common import INT_MAX
from anatomist.cli.requests import (
    LORA_FIELDS,
    TRAINER_FIELDS,
    DevicesRequest,
    EstimateRequest,
    ModelRequest,
    PlanRequest,
)
from anatomist.errors import InputError

View = Literal["estimate", "plan"]
VIEWS: tuple[str, ...] = ("estimate", "plan")
Kind = Literal["str", "int", "float", "choice", "bool", "flag", "multi", "upload"]
"""How a field is entered: bool is unset/true/false (`--x/--no-x`), flag is a checkbox (`--no-compile`),
multi a set of choices (`--optims a,b`), upload the id of an uploaded file."""

MAX_VALUE_CHARS = 300
"""Longest value a field takes (a Hub id is at most 96 characters, a module list rarely 100)."""
QUESTION = "question"
"""The group of the fields the page asks first (model, GPU, method, trainer, length, batch, GPUs, nodes)."""
_INT = re.compile(r"[+-]?\d+")
_UPLOAD_ID = re.compile(r"[0-9a-f]{16}")


class FieldError(InputError):
    """A bad value of one field: the message names the field and its limit; `field` lets the page point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(kw_only=True, slots=True, frozen=True)
class Field:
    """One input of the page."""

    name: str
    """The URL key: the CLI flag's destination (a TrainingArguments name for a recipe field)."""
    flag: str | None
    """The CLI flag (`--seq-len`); None for what service.py places itself (the model, the uploads)."""
    kind: Kind
    help: str
    label: str
    """What the page calls it ("Batch per GPU"); the name and the help are its tooltip."""
    group: str
    """QUESTION (asked first), else the title of its group under "advanced" (the CLI's help groups)."""
    choices: tuple[Any, ...] | None = None
    choice_labels: tuple[str, ...] | None = None
    """What the page shows for each choice, in the same order ("full fine-tuning" for none)."""
    default: Any = None
    """What applies when the field is left empty (shown as a placeholder, or checked)."""
    views: tuple[str, ...] = VIEWS
    minimum: float | None = None
    """The smallest value taken (an int or float field)."""
    maximum: float | None = None
    """The largest value taken (an int field: INT_MAX where not set)."""
    below_maximum: bool = False
    """The maximum itself is refused (a share: [0, 1))."""

    def to_dict(self) -> dict[str, Any]:
        maximum = self.maximum if self.maximum is not None or self.kind != "int" else INT_MAX
        return {"name": self.name, "flag": self.flag, "kind": self.kind, "help": self.help, "label": self.label,
                "group": self.group, "choices": list(self.choices) if self.choices is not None else None,
                "choice_labels": list(self.choice_labels) if self.choice_labels is not None else None,
                "default": self.default, "views": list(self.views), "minimum": self.minimum, "maximum": maximum,
                "below_maximum": self.below_maximum}

    def parse(self, text: str) -> Any:
        """The typed value of `text` (a non-empty string from the URL or the form).

        Raises:
            FieldError: a value of the wrong kind or past its limits, said with the field's label, name and limit.
        """
        if len(text) > MAX_VALUE_CHARS:
            raise self._error(f"must be at most {MAX_VALUE_CHARS} characters long, got {len(text)}")
        if self.kind == "int":
            if not _INT.fullmatch(text):
                raise self._error(f"must be a whole number, got {text!r}")
            return self._bounded(int(text), text)
        if self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise self._error(f"must be a number, got {text!r}")
            return self._bounded(value, text)
        if self.kind in ("bool", "flag"):
            if text not in ("true", "false"):
                raise self._error(f"must be true or false, got {text!r}")
            return text == "true"
        if self.kind == "choice":
            return self._choice(text)
        if self.kind == "multi":
            return tuple(self._choice(part.strip()) for part in text.split(",") if part.strip())
        if self.kind == "upload" and not _UPLOAD_ID.fullmatch(text):
            raise self._error(f"must be the id of an uploaded file, got {text!r}")
        return text

    def _bounded(self, value: float, text: str) -> float:
        maximum = self.maximum if self.maximum is not None or self.kind != "int" else INT_MAX
        if self.minimum is not None and value < self.minimum:
            raise self._error(f"must be at least {self.minimum:g}, got {text}")
        if maximum is not None and (value > maximum or (self.below_maximum and value >= maximum)):
            limit = "2^31 - 1 = 2,147,483,647" if maximum == INT_MAX else f"{maximum:g}"
            said = f"below {limit}" if self.below_maximum else f"at most {limit}"
            raise self._error(f"must be {said}, got {text}")
        return value

    def _choice(self, text: str) -> Any:
        by_text = {str(c): c for c in self.choices or ()}
        if text not in by_text:
            raise self._error(f"must be one of {', '.join(by_text)}; got {text!r}")
        return by_text[text]

    def _error(self, said: str) -> FieldError:
        return FieldError(self.name, f"{self.label} ({self.name}) {said}")

    def argv(self, value: Any) -> list[str]:
        """The CLI flags for `value` (`--flag=value` keeps a value starting with '-' a value)."""
        if self.flag is None:
            return []
        if self.kind == "bool":
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        if self.kind == "flag":
            return [self.flag] if value else []
        if self.kind == "multi":
            return [f"{self.flag}={','.join(map(str, value))}"]
        return [f"{self.flag}={value}"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Form:
    """What the page asks for: a view and the fields given (typed), nothing else."""

    view: View
    values: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """The same request, the same key (jobs are shared by key)."""
        return json.dumps({"view": self.view, **self.values}, sort_keys=True, default=list)

    def get(self, name: str) -> Any:
        return self.values.get(name)


def parse(params: Mapping[str, Any], fields: Iterable[Field]) -> Form:
    """Check `params` (the URL query or the page's JSON: strings; empty means unset) against `fields`.

    Raises:
        InputError: an unknown view or key, or a value of the wrong kind, naming the key.
    """
    view = str(params.get("view") or "estimate")
    if view not in VIEWS:
        raise InputError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
    known = {f.name: f for f in fields if view in f.views}
    values: dict[str, Any] = {}
    for name, raw in params.items():
        if name == "view":
            continue
        if name not in known:
            raise InputError(f"unknown field {name!r} for the {view} view; known: {', '.join(known)}")
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            continue
        if not isinstance(raw, (str, int, float, bool)):
            raise FieldError(name, f"{name}: expected a string, got {type(raw).__name__}")
        text = str(raw).lower() if isinstance(raw, bool) else str(raw).strip()
        value = known[name].parse(text)
        if value != ():
            values[name] = value
    return Form(view=view, values=values)  # type: ignore[arg-type]


def flags(form: Form, fields: Iterable[Field]) -> list[str]:
    """The CLI flags of the fields given, in the fields' order."""
    out: list[str] = []
    for f in fields:
        if form.view in f.views and f.name in form.values:
            out += f.argv(form.values[f.name])
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Files:
    """What the form's model and uploads name on the server (each checked as when it was uploaded)."""

    model: str | None
    """MODEL: a catalog name or Hub id, or the path of the uploaded config.json."""
    recipe: str | None = None
    """The uploaded recipe file's path."""
    lengths: str | None = None
    """The uploaded lengths file's path."""


def estimate_request(form: Form, files: Files, *, allow_network: bool) -> EstimateRequest:
    """The `anatomist estimate` request the estimate view's form asks (as the CLI reads it from `flags`)."""
    from anatomist.cli.estimate import DEFAULT_GPU
    from anatomist.recipe import Recipe

    get = form.values.get
    recipe = {f.name: form.values[f.name] for f in dataclasses.fields(Recipe) if f.name in form.values}
    return EstimateRequest(model=_model_request(form, files, allow_network), gpu=get("gpu", DEFAULT_GPU),
                           devices=_devices_request(form), recipe_file=files.recipe, recipe=recipe,
                           mode=get("mode", "train"), memory_margin=get("memory_margin", DEFAULT_MEMORY_MARGIN),
                           longest_seq_len=bool(get("longest_seq_len", False)))


def plan_request(form: Form, files: Files, *, allow_network: bool) -> PlanRequest:
    """The `anatomist plan` request the plan view's form asks (as the CLI reads it from `flags`)."""
    get = form.values.get
    given = {name: value for name, value in form.values.items() if value is not False}  # an unticked flag: not given
    return PlanRequest(
        model=_model_request(form, files, allow_network), gpu=form.values["gpu"], recipe_file=files.recipe,
        global_batch_size=get("global_batch_size"), devices=_devices_request(form), max_nodes=get("max_nodes"),
        objective=get("objective", "throughput"), memory_margin=get("memory_margin", DEFAULT_MEMORY_MARGIN),
        optims=tuple(get("optims", DEFAULT_SEARCH)), precisions=get("precisions"), shardings=get("shardings"),
        no_compile=bool(get("no_compile")), no_liger_kernel=bool(get("no_liger_kernel")),
        no_tensor_parallel=bool(get("no_tensor_parallel")), peft=get("peft", ()),
        lora={name: given[name] for name in LORA_FIELDS if name in given},
        trainer={name: given[name] for name in TRAINER_FIELDS if name in given},
    )


def _model_request(form: Form, files: Files, allow_network: bool) -> ModelRequest:
    get = form.values.get
    return ModelRequest(model=files.model, seq_len=get("seq_len"), task=get("task"), allow_network=allow_network,
                        avg_seq_len=get("avg_seq_len"), lengths=files.lengths, prompt_len=get("prompt_len"))


def _devices_request(form: Form) -> DevicesRequest:
    get = form.values.get
    return DevicesRequest(gpus=get("gpus"), nodes=get("nodes"), network=get("network"))
