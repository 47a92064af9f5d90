"""The foundation of the cluster-config schema (coordinator/config_schema.py): `ConfigError`, the
`doc()` metadata every field carries, the `Section` base Struct, and reading the schema back
(`field_specs`, `type_name`, `public`) for error messages, overrides and the generated docs.
"""
from __future__ import annotations

import types
import typing
from functools import lru_cache
from typing import Annotated, Any, Literal, Mapping, NamedTuple

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from router.pairing import POLICY_TYPES

ENV_PREFIX = "SPLITSERVE_"
ROUTER_TYPES = POLICY_TYPES     # router/pairing.py `PolicyKind`: the types and their traits
REDACTED = "<redacted>"
# `ClusterConfig._source` (the document it was loaded from, for `apply_overrides`) is renamed to a
# key no config file can use: it is never an input key (coordinator/config_upstream.py rejects it).
SOURCE_KEY = "<source document>"


class ConfigError(ValueError):
    """An invalid configuration. `path` is the dotted key path (`""` for the document itself)."""

    def __init__(self, path: str, message: str, *, kind: str = "invalid"):
        self.path = path
        self.message = message
        self.kind = kind  # "type" | "unknown_key" | "invalid"
        super().__init__(f"{path}: {message}" if path else message)


def doc(text: str, *, upstream: bool = False, secret: bool = False, engine: bool = False,
        parse: str | None = None) -> Meta:
    """A field's documentation: its one-line meaning; `upstream` marks trtllm-serve keys, `engine`
    the engine-level keys of a server section (kept in `engine_args`), `parse="bytes"` a size that
    may be written '4MiB'."""
    return Meta(description=text, extra={"upstream": upstream, "secret": secret, "engine": engine,
                                         "parse": parse})


NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(gt=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]


def _frozen_mapping(v: Any) -> Any:
    return types.MappingProxyType({k: freeze(x) for k, x in v.items()})


def freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return _frozen_mapping(v)
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def thaw(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [thaw(x) for x in v]
    return v


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def show(v: Any, secret: bool = False) -> str:
    """A found value for an error message: its type and (unless secret) a short repr."""
    if secret:
        return f"{type(v).__name__} {REDACTED}"
    r = repr(v)
    if len(r) > 80:
        r = r[:77] + "..."
    return f"{type(v).__name__} {r}"


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every schema Struct: frozen, strict (unknown keys are errors)."""

    def _freeze_fields(self, *names: str) -> None:
        for n in names:
            msgspec.structs.force_setattr(self, n, _frozen_mapping(getattr(self, n)))



# ----------------------------------------------------------------------------- introspection

class FieldSpec(NamedTuple):
    """One key of the schema, read from its Struct (msgspec.inspect) and its `doc()`."""
    name: str
    type: Any              # msgspec.inspect type, its Metadata unwrapped
    doc: str
    upstream: bool
    secret: bool
    engine: bool
    parse: str | None
    required: bool
    default: Any           # the default value (a factory's product), or None when required


def unwrap(t: Any) -> Any:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def non_null(t: Any) -> Any:
    """The type inside `X | None` (unwrapped), else `t` unwrapped."""
    t = unwrap(t)
    if isinstance(t, mi.UnionType):
        inner = [unwrap(a) for a in t.types if not isinstance(a, mi.NoneType)]
        if len(inner) == 1:
            return inner[0]
    return t


def struct_of(t: Any) -> type | None:
    """The Struct class a field holds (directly or as `X | None`), else None."""
    t = non_null(t)
    return t.cls if isinstance(t, mi.StructType) else None


def _declared_literal(ann: Any) -> tuple | None:
    """The values of the first `Literal[...]` in a field's annotation, in the order written."""
    if typing.get_origin(ann) is Literal:
        return typing.get_args(ann)
    for a in typing.get_args(ann):
        found = _declared_literal(a)
        if found is not None:
            return found
    return None


def _in_order(t: Any, values: tuple) -> Any:
    """`t` with its LiteralType's values in declaration order (msgspec.inspect sorts them)."""
    if isinstance(t, mi.LiteralType):
        return mi.LiteralType(values=values)
    if isinstance(t, mi.UnionType):
        return mi.UnionType(types=tuple(_in_order(a, values) for a in t.types))
    return t


@lru_cache(maxsize=None)
def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """The schema keys of `cls` in declaration order (the internal `_source` left out)."""
    out = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in mi.type_info(cls).fields:
        if f.name.startswith("_"):
            continue
        t = f.type
        meta = t.extra if isinstance(t, mi.Metadata) and t.extra else {}
        desc = t.extra_json_schema.get("description", "") if isinstance(t, mi.Metadata) \
            and t.extra_json_schema else ""
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = None
        lit = _declared_literal(hints[f.name])
        out.append(FieldSpec(f.name, unwrap(t) if lit is None else _in_order(unwrap(t), lit), desc, bool(meta.get("upstream")),
                             bool(meta.get("secret")), bool(meta.get("engine")), meta.get("parse"),
                             f.required, default))
    return tuple(out)


def type_name(t: Any) -> str:
    """What an error message or the docs call a schema type."""
    t = unwrap(t)
    if isinstance(t, mi.AnyType):
        return "any value"
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.IntType):
        return "int"
    if isinstance(t, mi.FloatType):
        return "number"
    if isinstance(t, mi.StrType):
        return "string"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(a) for a in t.values)
    if isinstance(t, mi.UnionType):
        inner = [a for a in t.types if not isinstance(unwrap(a), mi.NoneType)]
        return " or ".join(type_name(a) for a in inner) + " or null"
    if isinstance(t, mi.VarTupleType):
        return f"list of {type_name(t.item_type)}"
    if isinstance(t, (mi.StructType, mi.DictType)):
        return "mapping"
    return type(t).__name__


def public(obj: Any) -> Any:
    """A schema object as plain JSON-able data, secrets redacted."""
    if isinstance(obj, Section):
        out = {}
        for f in field_specs(type(obj)):
            v = getattr(obj, f.name)
            if f.secret:
                out[f.name] = [REDACTED] * len(v) if isinstance(v, tuple) else (REDACTED if v else None)
            else:
                out[f.name] = public(v)
        return out
    if isinstance(obj, Mapping):
        return {k: public(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [public(v) for v in obj]
    return obj
