"""The schema language eyas.metadata writes its schemas in, and the checker that applies one to a parsed file.

A `Field` says what one key holds: its JSON type, bounds, allowed values, the fields of an object, the entries of an
array (objects with fields, or values of one kind) and the values of a map (`each`). Kind "file" is a string naming a
file inside the folder the metadata file lives in (eyas.files.inside: no absolute path, no '..', no link out), so
every path a manifest records is checked where the manifest is read, before any reader joins it onto its folder.
A `Schema` adds rules across fields (a shard's loss tokens within its tokens, a watermark past its rows). The first
problem found is reported as "'<field>' should be <what>, found <value>", the field named by its path
(`shards[0].file`, `layout.aux_indices[1]`), for the reader to raise as one error line naming the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import inside

KINDS = {"object": (dict,), "array": (list,), "string": (str,), "int": (int,), "number": (int, float),
         "bool": (bool,), "file": (str,), "value": (str, int, float, bool, list)}
WORDS = {"object": "a JSON object", "array": "a JSON array", "string": "a string", "int": "a whole number",
         "number": "a number", "bool": "true or false", "file": "a file name inside the folder",
         "value": "a plain value (a string, number, true/false or list)"}
# no count, size or id eyas stores is beyond torch's int64; a larger JSON number is damage, not data
INT_MAX = 2**63 - 1


def bound(x: float) -> str:
    """A bound as an error shows it: whole numbers in full (a vocab ceiling is 2147483647, not 2.14748e+09)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Field:
    key: str
    kind: str  # a key of KINDS
    required: bool = True
    low: float | None = None  # int and number: the smallest valid value; array: the fewest entries
    high: float | None = None  # int and number: the largest valid value; array: the most entries
    nullable: bool = False  # null stands for "not known" (foreign configs write it, eyas writes it for unset options)
    fields: tuple[Field, ...] = ()  # object: the fields inside it
    entries: tuple[Field, ...] = ()  # array: each entry is an object with these fields
    each: Field | None = None  # array: every entry is this; object: every value is this (a map; the key unused)
    choices: tuple[Any, ...] = ()  # the only values allowed
    pattern: str | None = None  # string: the whole string matches this regex (digests, hashes)
    file_keys: bool = False  # object: every key is a file name inside the folder (a `files` record)

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        word = WORDS[self.kind]
        if self.kind == "array":
            if self.low is not None and self.low == self.high:
                word += f" of {self.low:g} entries"
            elif self.low:
                word += f" of at least {self.low:g} entries"
            return word + (f", each {self.each.describe()}" if self.each is not None else "")
        if self.pattern is not None:
            return f"{word} like {self.pattern!r}"
        if self.file_keys:
            word += " keyed by file names inside the folder"
        if self.kind == "object" and self.each is not None and not self.each.fields:
            return f"{word}, each value {self.each.describe()}"
        low = self.low
        high = self.high if self.high is not None and self.high < INT_MAX else None
        if low is not None and high is not None:
            return f"{word} in {bound(low)}..{bound(high)}"
        if low is not None:
            return f"{word} >= {bound(low)}"
        if high is not None:
            return f"{word} <= {bound(high)}"
        return word


@dataclass(frozen=True)
class Schema:
    what: str  # how an error names the file's role, e.g. "shard manifest"
    fields: tuple[Field, ...]
    # checks across fields, run once every field fits: each returns "'<field>' ..." or None
    rules: tuple[Callable[[dict[str, Any]], str | None], ...] = ()


def shown(v: Any) -> str:
    """A found value as an error shows it: short, and never a whole nested structure."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float, str)):
        return repr(v)[:60]
    return f"a {'JSON object' if isinstance(v, dict) else 'JSON array' if isinstance(v, list) else type(v).__name__}"


def child(name: str, key: str | int) -> str:
    """How an error names an entry of field `name`: `shards[0]`, `layout.norms.final`, `files['model.safetensors']`
    (a key that is not one word is quoted, so a dotted key never reads as nesting)."""
    if isinstance(key, int):
        return f"{name}[{key}]"
    if re.fullmatch(r"\w+", key):
        return f"{name}.{key}" if name else key
    return f"{name}[{key!r}]"


def check_value(v: Any, f: Field, name: str, folder: Path | None) -> str | None:
    """Why value `v` of field `name` does not fit `f` (None when it does); folder: where kind-"file" names point."""
    if v is None and f.nullable:
        return None
    # bool is an int in Python, never in these files
    fits = isinstance(v, KINDS[f.kind]) and (f.kind in ("bool", "value") or not isinstance(v, bool))
    if fits and f.kind in ("int", "number"):
        low = f.low if f.low is not None else -INT_MAX
        high = f.high if f.high is not None else INT_MAX
        fits = low <= v <= high  # also refuses NaN and infinities, which compare false
    if fits and f.kind == "array" and f.low is not None:
        fits = f.low <= len(v) <= (f.high if f.high is not None else INT_MAX)
    if fits and f.choices:
        fits = v in f.choices
    if fits and f.pattern is not None:
        fits = re.fullmatch(f.pattern, v) is not None
    if not fits:
        return f"'{name}' should be {f.describe()}, found {shown(v)}"
    if f.kind == "file" and folder is not None:
        why = inside(folder, v)
        if why is not None:
            return f"'{name}' should be a file name inside {folder}, found {shown(v)} ({why})"
    if f.fields:
        problem = check_fields(v, f.fields, name, folder)
        if problem:
            return problem
    for i, e in enumerate(v if f.entries else ()):
        if not isinstance(e, dict):
            return f"'{child(name, i)}' should be a JSON object, found {shown(e)}"
        problem = check_fields(e, f.entries, child(name, i), folder)
        if problem:
            return problem
    if f.each is not None or f.file_keys:
        items: Iterable[tuple[Any, Any]] = enumerate(v) if f.kind == "array" else v.items()  # index or key
        for k, e in items:
            sub = child(name, k)
            if f.file_keys and folder is not None and (why := inside(folder, k)) is not None:
                return f"'{sub}' should name a file inside {folder}, found {shown(k)} ({why})"
            problem = check_value(e, f.each, sub, folder) if f.each is not None else None
            if problem:
                return problem
    return None


def check_fields(data: dict[str, Any], fields: tuple[Field, ...], where: str = "",
                 folder: Path | None = None) -> str | None:
    """The first field of object `where` (its name; "" at the top) that does not fit `fields`, as "'key' should
    be ..., found ..."; None if all do."""
    for f in fields:
        name = child(where, f.key)
        if f.key not in data:
            if f.required:
                return f"'{name}' should be {f.describe()}, found nothing"
            continue
        problem = check_value(data[f.key], f, name, folder)
        if problem:
            return problem
    return None


def check_schema(data: dict[str, Any], schema: Schema, folder: Path | None = None) -> str | None:
    """The first problem of `data` against `schema`: its fields, then its rules across fields."""
    problem = check_fields(data, schema.fields, "", folder)
    for rule in () if problem else schema.rules:
        problem = rule(data)
        if problem:
            break
    return problem


def field_rows(fields: tuple[Field, ...], where: str = "") -> list[tuple[str, str, bool]]:
    """(path, what it holds, required) for every field, nested ones after their parent: the reference table."""
    rows: list[tuple[str, str, bool]] = []
    for f in fields:
        name = child(where, f.key) if f.key else where
        rows.append((name, f.describe() + (", or null" if f.nullable else ""), f.required))
        if f.fields:
            rows += field_rows(f.fields, name)
        if f.entries:
            rows += field_rows(f.entries, f"{name}[i]")
        if f.each is not None and f.each.fields:
            rows += field_rows(f.each.fields, f"{name}[key]" if f.kind == "object" else f"{name}[i]")
    return rows


def schema_markdown(schema: Schema, title: str) -> str:
    """A schema as the Markdown table docs/CONTRACTS.md holds (generated, so the doc cannot drift)."""
    lines = [f"### {title} — {schema.what}", "", "| field | holds | required |", "|---|---|---|"]
    for name, what, required in field_rows(schema.fields):
        cell = what.replace("|", r"\|")  # a regex alternation would end the table cell
        lines.append(f"| `{name}` | {cell} | {'yes' if required else ''} |")
    if schema.rules:
        lines += ["", "Across fields: " + "; ".join((r.__doc__ or r.__name__).split("\n")[0].strip()
                                                    for r in schema.rules)]
    return "\n".join(lines)
