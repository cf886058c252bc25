"""Records declared once: the compiler that derives a record's encoder,
decoder and checks from its annotated fields.

A record is a frozen dataclass whose fields are annotated with their wire
type (:mod:`bridge.wire._fields`), in wire order: ``epoch: Annotated[int,
U64(low=1)]``. :func:`declared` reads the annotations once, at import, and
gives the class

* ``_pack(version) -> bytes``: its bytes as a peer of ``version`` reads them;
* ``_unpack(data, pos, end, version, what)``: the record at ``pos`` and the
  position after it, read in wire order, so the first fault reported is the
  first on the wire;
* ``__post_init__``: each field's checks, then the class's own
  ``_invariant`` (rules across fields), so nothing that cannot be sent can
  be built; decoding builds through the constructor and so checks the same.

The three are generated as Python source, as :mod:`dataclasses` generates
``__init__``: fixed-size fields in a row, and the length prefix after them,
become one precompiled :class:`struct.Struct`, and no call per field is left
on the paths every frame takes.

Presence is declared too: :class:`Since` marks the fields a protocol
version added (a peer of an older version neither sends nor reads them; they
take their default), and :class:`Trailing` an optional trailing part (sent only
when not at its default, and at its default to a peer without its
capability; read when bytes remain).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Self, TypeVar, cast, get_type_hints

from bridge._errors import BadFrame
from bridge._ids import ReplicationId

from ._fields import Blob, Composite, Field, Fixed, Text, check_text, short_run, truncated

__all__ = ["Declared", "Nested", "Since", "Trailing", "declared"]

_R = TypeVar("_R", bound="type[Declared]")


@dataclass(frozen=True, slots=True)
class Since:
    """The field is on the wire from protocol ``version`` on."""

    version: int


@dataclass(frozen=True, slots=True)
class Trailing:
    """The field belongs to the record's optional trailing part: on the wire
    only when one of its fields is not at its default, sent at the defaults
    to a peer without ``capability`` (0: any peer), read when bytes remain."""

    capability: int = 0


class Nested(Composite):
    """A nested record, a field type: a :func:`declared` class (checked by
    its own constructor), or ``make`` built from ``parts`` in order
    (``make=tuple``: a plain tuple), compiled here."""

    __slots__ = ("make", "parts", "piece", "unpack")

    def __init__(self, make: Any, **parts: Field) -> None:
        self.make, self.parts = make, parts
        if parts:
            layout = [_Slot(name, field, None, None, MISSING) for name, field in parts.items()]
            make = _compile_codec(make.__name__, layout, make, list(parts), by_index=make is tuple)
        # the record's own functions: no call between an array and them
        self.piece, self.unpack = make._pack, make._unpack  # type: ignore[method-assign]

    def check(self, label: str, value: Any) -> None:
        for i, (name, field) in enumerate(self.parts.items()):
            part = value[i] if self.make is tuple else getattr(value, name)
            field.check(f"{label}.{name}", part)

    def pieces(self, value: Any, version: int) -> list[bytes]:
        return [self.piece(value, version)]


# ---------------------------------------------------------------- the compiler


class Declared:
    """Base of the records :func:`declared` compiles."""

    __slots__ = ()
    #: (field, capability, default) of each field a peer needs a capability for
    _capable: ClassVar[tuple[tuple[str, int, Any], ...]] = ()
    #: every capability some field needs
    _needs: ClassVar[int] = 0

    def __post_init__(self) -> None:
        raise TypeError(f"{type(self).__name__} is not declared")

    def _pack(self, version: int) -> bytes:
        raise TypeError(f"{type(self).__name__} is not declared")

    @classmethod
    def _unpack(cls, data: bytes, pos: int, end: int, version: int, what: str) -> tuple[Self, int]:
        raise TypeError(f"{cls.__name__} is not declared")

    def _invariant(self) -> None:
        """Rules across fields, after each field's own checks."""


@dataclass(slots=True)
class _Slot:
    name: str
    field: Field
    since: Since | None
    tail: Trailing | None
    default: Any

    @property
    def group(self) -> Since | Trailing | None:
        return self.since or self.tail


def declared(cls: _R) -> _R:
    """Compile ``cls``'s ``_pack``, ``_unpack`` and ``__post_init__`` from its
    annotations (``WIRE_ORDER``, if set, names the fields in wire order)."""
    hints = get_type_hints(cls, include_extras=True)
    slots = {}
    for f in fields(cast(Any, cls)):
        if f.name.startswith("_"):  # the generated functions' own names start with "_"
            raise TypeError(f"{cls.__name__}.{f.name}: a wire field's name starts with a letter")
        meta = getattr(hints[f.name], "__metadata__", ())
        field = next((m for m in meta if isinstance(m, Field)), None)
        if field is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no wire type")
        since = next((m for m in meta if isinstance(m, Since)), None)
        tail = next((m for m in meta if isinstance(m, Trailing)), None)
        slots[f.name] = _Slot(f.name, field, since, tail, f.default)
    layout = [slots[name] for name in getattr(cls, "WIRE_ORDER", slots)]
    for s in layout:
        if s.group and s.default is MISSING:
            raise TypeError(f"{cls.__name__}.{s.name} is optional on the wire: it needs a default")
    compiled = _compile_codec(cls.__name__, layout, cls, list(slots), by_index=False)
    cls._pack = compiled._pack  # type: ignore[method-assign]
    cls._unpack = staticmethod(compiled._unpack)  # type: ignore[method-assign]
    cls.__post_init__ = _compile_checks(cls, list(slots.values()))  # type: ignore[method-assign]
    cls._capable = tuple(
        (s.name, s.tail.capability, s.default) for s in layout if s.tail and s.tail.capability
    )
    for _, capability, _ in cls._capable:
        cls._needs |= capability
    return cls


class _Source:
    """Python source being generated, with the names it refers to."""

    def __init__(self, ns: dict[str, Any]) -> None:
        self.lines: list[str] = []
        self.ns = ns

    def bind(self, value: Any, prefix: str) -> str:
        name = f"_{prefix}{len(self.ns)}"
        self.ns[name] = value
        return name

    def add(self, indent: int, *lines: str) -> None:
        self.lines += ["    " * indent + line for line in lines]

    def function(self, name: str, head: str, owner: str) -> Callable[..., Any]:
        text = f"def {name}({head}):\n" + "\n".join(self.lines or ["    pass"]) + "\n"
        code = compile(text, f"<{owner}.{name}, compiled from its declaration>", "exec")
        exec(code, self.ns)  # noqa: S102 - source built above from the declaration
        fn: Callable[..., Any] = self.ns[name]
        fn.__qualname__ = f"{owner}.{name}"
        return fn


def _base_ns() -> dict[str, Any]:
    return {
        "BadFrame": BadFrame,
        "_ReplicationId": ReplicationId,
        "_check_text": check_text,
        "_setattr": object.__setattr__,
        "_short": short_run,
        "_truncated": truncated,
    }


def _groups(layout: list[_Slot]) -> list[tuple[Since | Trailing | None, list[_Slot]]]:
    """The layout cut where presence changes; optional parts come last."""
    groups: list[tuple[Since | Trailing | None, list[_Slot]]] = []
    for s in layout:
        if groups and groups[-1][0] == s.group:
            groups[-1][1].append(s)
        elif groups and groups[-1][0] is not None and s.group is None:
            raise TypeError(f"{s.name}: a required field after an optional one")
        else:
            groups.append((s.group, [s]))
    return groups or [(None, [])]


class _Codec:
    """Generates one record's ``_pack`` and ``_unpack``. Fixed fields in a
    row, and the length prefix after them, form a run: one struct packs or
    unpacks it, and one length test guards it on decoding."""

    def __init__(self, owner: str, layout: list[_Slot], by_index: bool) -> None:
        self.owner, self.layout, self.by_index = owner, layout, by_index
        self.groups = _groups(layout)
        self.pack, self.unpack = _Source(_base_ns()), _Source(_base_ns())
        self.refs = {s.name: self.pack.bind(s.field, "f") for s in layout}
        self.unpack.ns.update(self.pack.ns)

    def get(self, s: _Slot) -> str:
        return f"self[{self.layout.index(s)}]" if self.by_index else f"self.{s.name}"

    # encoding

    def pieces(self, indent: int, slots: list[_Slot]) -> list[str]:
        """Expressions of one group's bytes (their set-up lines added)."""
        out: list[str] = []
        run: list[str] = []  # struct codes and the values packed, in order
        codes = ""
        for s in slots:
            field = s.field
            if isinstance(field, Fixed):
                codes += field.code
                run.append(field.to_wire(self.get(s), self.refs[s.name]))
                continue
            if isinstance(field, Text | Blob):
                raw = f"_b{self.layout.index(s)}"
                self.pack.add(indent, f"{raw} = {field.to_bytes(self.get(s))}")
                codes += field.prefix.code
                run.append(f"len({raw})")
            if run:
                packer = self.pack.bind(struct.Struct(">" + codes).pack, "p")
                out.append(f"{packer}({', '.join(run)})")
                run, codes = [], ""
            if isinstance(field, Text | Blob):
                out.append(raw)
            elif isinstance(field, Composite):
                out.append(f"*{self.refs[s.name]}.pieces({self.get(s)}, _version)")
        if run:
            out.append(f"{self.pack.bind(struct.Struct('>' + codes).pack, 'p')}({', '.join(run)})")
        return out

    def compile_pack(self) -> Callable[..., Any]:
        groups = self.groups
        if len(groups) == 1 and groups[0][0] is None:
            first = self.pieces(1, groups[0][1])
            if len(first) <= 3 and not any(p.startswith("*") for p in first):
                self.pack.add(1, f"return {' + '.join(first) or repr(b'')}")
            else:
                self.pack.add(1, f"return b''.join(({', '.join(first)},))")
            return self.pack.function("_pack", "self, _version", self.owner)
        if groups[0][0] is None:
            self.pack.add(1, f"out = [{', '.join(self.pieces(1, groups[0][1]))}]")
            groups = groups[1:]
        else:
            self.pack.add(1, "out = []")
        for group, slots in groups:
            if isinstance(group, Since):
                self.pack.add(1, f"if _version >= {group.version}:")
            else:  # a tail: there when a field is not at its default
                tests = [f"{self.get(s)} != {self.pack.bind(s.default, 'd')}" for s in slots]
                self.pack.add(1, f"if {' or '.join(tests)}:")
            self.pack.add(2, f"out += [{', '.join(self.pieces(2, slots))}]")
        self.pack.add(1, "return b''.join(out)")
        return self.pack.function("_pack", "self, _version", self.owner)

    # decoding

    def read_run(self, indent: int, run: list[tuple[str, Fixed, str]]) -> None:
        """Unpack ``run`` (label, field, variable) after one length test."""
        size = sum(f.size for _, f, _ in run)
        unpacker = self.unpack.bind(struct.Struct(">" + "".join(f.code for _, f, _ in run)), "u")
        labels = self.unpack.bind(tuple((label, f) for label, f, _ in run), "r")
        self.unpack.add(
            indent,
            f"if _end - _pos < {size}:",
            f"    raise _short(_data, _pos, _end, _what, {labels})",
            f"{', '.join(v for _, _, v in run)}, = {unpacker}.unpack_from(_data, _pos)",
            f"_pos += {size}",
        )
        for label, f, var in run:
            if var != "_n":  # not a length prefix
                self.unpack.add(indent, *f.from_wire(var, self.refs[label], label))

    def reads(self, indent: int, slots: list[_Slot]) -> None:
        """Lines decoding one group into variables named as the fields."""
        run: list[tuple[str, Fixed, str]] = []
        for s in slots:
            field, name = s.field, s.name
            if isinstance(field, Fixed):
                run.append((name, field, name))
                continue
            if isinstance(field, Text | Blob):
                run.append((name, field.prefix, "_n"))
            if run:
                self.read_run(indent, run)
                run = []
            if isinstance(field, Text | Blob):
                self.unpack.add(
                    indent,
                    "_e = _pos + _n",
                    "if _e > _end:",
                    f"    raise _truncated(_what, {name!r})",
                    *field.from_bytes(name, "_pos", "_e", name),
                    "_pos = _e",
                )
            elif isinstance(field, Composite):
                context = "".join(f", {c}" for c in field.context)
                call = f"_data, _pos, _end, _version, _what, {name!r}{context}"
                self.unpack.add(indent, f"{name}, _pos = {self.refs[name]}.unpack({call})")
        if run:
            self.read_run(indent, run)

    def compile_unpack(self, make: Any, arguments: list[str]) -> Callable[..., Any]:
        for group, slots in self.groups:
            if group is None:
                self.reads(1, slots)
                continue
            test = f"_version >= {group.version}" if isinstance(group, Since) else "_pos < _end"
            self.unpack.add(1, f"if {test}:")
            self.reads(2, slots)
            self.unpack.add(1, "else:")
            for s in slots:
                self.unpack.add(2, f"{s.name} = {self.unpack.bind(s.default, 'd')}")
        if self.by_index:
            self.unpack.add(1, f"return ({', '.join(arguments)},), _pos")
        else:
            built = f"{self.unpack.bind(make, 'm')}({', '.join(arguments)})"
            self.unpack.add(1, f"return {built}, _pos")
        return self.unpack.function(
            "_unpack", "_data, _pos, _end, _version, _what, _label=None", self.owner
        )


class _Compiled:
    """The functions compiled for a record that is not a declared class."""

    def __init__(self, pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
        self._pack, self._unpack = pack, unpack


def _compile_codec(
    owner: str, layout: list[_Slot], make: Any, arguments: list[str], *, by_index: bool
) -> _Compiled:
    """``_pack`` and ``_unpack`` for ``layout``; the record is built as
    ``make(*arguments)`` (a tuple of them, ``by_index``)."""
    codec = _Codec(owner, layout, by_index)
    return _Compiled(codec.compile_pack(), codec.compile_unpack(make, arguments))


def _compile_checks(cls: type[Declared], slots: list[_Slot]) -> Callable[..., None]:
    src = _Source(_base_ns())
    for s in slots:
        ref = src.bind(s.field, "f")
        src.add(1, *s.field.check_code(s.name, f"self.{s.name}", ref))
    if cls._invariant is not Declared._invariant:
        src.add(1, "self._invariant()")
    return src.function("__post_init__", "self", cls.__name__)
