"""What values each Recipe field takes, read from its annotation: the type check of a value read from a file or
a flag, and the choices the flags and the page offer."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from typing import Any, Literal, get_args, get_origin, get_type_hints

from anatomist.recipe.fields import RecipeFields


@dataclass(frozen=True, slots=True)
class FieldKind:
    """What values a Recipe field takes, read from its annotation: one scalar type, maybe choices, maybe None."""

    type: type
    """bool, int, float or str."""
    choices: tuple[Any, ...] | None
    """The Literal's values; None for a free value."""
    optional: bool
    """None is a value (`str | None`)."""

    def accepts(self, value: Any) -> bool:
        """The type check of a value read from a file (its choices are checked by Recipe itself)."""
        if value is None:
            return self.optional
        if self.type is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.type is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, self.type)

    def describe(self) -> str:
        return self.type.__name__ + (" or null" if self.optional else "")


@cache
def field_kinds() -> dict[str, FieldKind]:
    """Each Recipe field's FieldKind, by name (the annotations here are strings: resolved once)."""
    kinds = {}
    listed = {f.name: f.metadata["choices"] for f in fields(RecipeFields) if "choices" in f.metadata}
    for name, hint in get_type_hints(RecipeFields).items():
        args = get_args(hint)
        optional = type(None) in args and get_origin(hint) is not Literal
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
        if get_origin(hint) is Literal:
            choices = get_args(hint)
            kinds[name] = FieldKind(type=type(choices[0]), choices=choices, optional=optional)
        else:  # a registry's names (optimizers) are choices too
            kinds[name] = FieldKind(type=hint, choices=listed.get(name), optional=optional)
    return kinds
