"""One reader for eyas's metadata files: a shard folder's manifest.json, a draft's or checkpoint's
eyas_manifest.json, an export's eyas_manifest.json, a checkpoint's trainer_state.json and a draft folder's
config.json (the file SGLang and vLLM read).

Each file has a `Schema`: the fields readers index, their JSON types and lower bounds. `read_metadata` parses the
file and checks it against its schema, so a damaged file (not JSON, empty, a field missing, of the wrong type or
out of range) is one error naming the file, the field and the fix, never a KeyError or TypeError deep in a reader.
What a value means for one run (a step past the run's last, a layout other than the data's) is the caller's check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EyasError

KINDS = {"object": (dict,), "array": (list,), "string": (str,), "int": (int,), "number": (int, float),
         "bool": (bool,)}
WORDS = {"object": "a JSON object", "array": "a JSON array", "string": "a string", "int": "a whole number",
         "number": "a number", "bool": "true or false"}


@dataclass(frozen=True)
class Field:
    key: str
    kind: str  # a key of KINDS
    required: bool = True
    low: float | None = None  # int and number: the smallest valid value
    nullable: bool = False  # null stands for "not known" (foreign configs write it)
    fields: tuple[Field, ...] = ()  # object: the fields inside it
    entries: tuple[Field, ...] = ()  # array: each entry is an object with these fields

    def describe(self) -> str:
        return WORDS[self.kind] + (f" >= {self.low:g}" if self.low is not None else "")


@dataclass(frozen=True)
class Schema:
    what: str  # how an error names the file's role, e.g. "shard manifest"
    fields: tuple[Field, ...]


def _counts(*keys: str, required: bool = True) -> tuple[Field, ...]:
    return tuple(Field(k, "int", required=required, low=0) for k in keys)


LAYOUT = Field("layout", "object", fields=(Field("aux_indices", "array"),))
SHARD_MANIFEST = Schema("shard manifest", (
    Field("kind", "string"), Field("format_version", "int", low=1), LAYOUT,
    Field("shards", "array", entries=(Field("file", "string"), *_counts("samples", "tokens"),
                                      Field("bytes", "int", required=False, low=0),
                                      Field("digest", "string", required=False))),
    Field("counts", "object", required=False), Field("config", "object", required=False),
    Field("skipped", "object", required=False), Field("commands", "array", required=False),
    Field("watermark", "int", required=False, low=-1)))
_DRAFT_FIELDS = (
    Field("kind", "string"), Field("format_version", "int", required=False, low=1), LAYOUT,
    Field("draft_config", "object"), Field("files", "object", required=False),
    *_counts("step", "total_steps", "tokens_seen", required=False),
    Field("metrics", "object", required=False, nullable=True), Field("target", "object", required=False),
    Field("chat_template", "object", required=False, nullable=True), Field("lineage", "array", required=False))
DRAFT_MANIFEST = Schema("draft manifest", _DRAFT_FIELDS)
# a checkpoint's manifest is a draft manifest that also records what resuming must match
CHECKPOINT_MANIFEST = Schema("checkpoint manifest", (
    *(f for f in _DRAFT_FIELDS if f.key != "step"), Field("step", "int", low=0),
    Field("draft_vocab", "object", fields=(Field("hash", "string"),)), Field("data", "object")))
EXPORT_MANIFEST = Schema("export manifest", (
    Field("kind", "string"), Field("format_version", "int", required=False, low=1),
    Field("format", "string", required=False), Field("files", "object", required=False),
    Field("layout", "object", required=False, fields=(Field("aux_indices", "array"),)),
    Field("draft_config", "object", required=False), Field("launch", "object", required=False)))
TRAINER_STATE = Schema("trainer state", (
    *_counts("step", "epoch", "batch_in_epoch", "tokens_seen"),
    Field("train_time_s", "number", required=False, low=0), Field("world_size", "int", required=False, low=1),
    Field("config", "object"), Field("optimizer", "object", fields=(Field("param_groups", "array"),)),
    Field("files", "object", required=False)))
# the draft config engines read: foreign tools write other keys and null for unknowns, so nothing is required,
# but a size that is there is a positive whole number and the id lists are lists
_SIZES = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "num_hidden_layers", "vocab_size", "draft_vocab_size", "max_position_embeddings")
DRAFT_CONFIG = Schema("draft config", (
    Field("architectures", "array", required=False, nullable=True),
    Field("model_type", "string", required=False, nullable=True),
    *(Field(k, "int", required=False, low=1, nullable=True) for k in _SIZES),
    Field("eagle_config", "object", required=False, nullable=True),
    Field("eagle_aux_hidden_state_layer_ids", "array", required=False, nullable=True)))
# any eyas manifest, before its kind says which schema it has (inspect reads folders of every kind)
ANY_MANIFEST = Schema("eyas manifest", (Field("kind", "string"),))
BY_KIND = {"eyas-shards": SHARD_MANIFEST, "eyas-draft": DRAFT_MANIFEST, "eyas-export": EXPORT_MANIFEST}
SCHEMAS = (SHARD_MANIFEST, DRAFT_MANIFEST, CHECKPOINT_MANIFEST, EXPORT_MANIFEST, TRAINER_STATE, DRAFT_CONFIG)


def read_metadata(path: str | Path, schema: Schema, error: type[EyasError], fix: str,
                  kind: str | None = None) -> dict[str, Any]:
    """The JSON object in `path`, checked against `schema`; anything else raises `error` naming the file, the
    field and `fix`. kind: the "kind" the file must declare, checked first (another tool's file of the same name
    is named as such, not as a damaged one)."""
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise error(f"{path} is not valid JSON (not UTF-8 text: {e.reason}); {fix}") from e
    if not text.strip():
        raise error(f"{path} is empty, expected the {schema.what} (an interrupted write?); {fix}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}") from e
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, expected the {schema.what} as an object; {fix}")
    if kind is not None and data.get("kind") != kind:
        raise error(f"{path}: kind {data.get('kind')!r}, expected {kind!r}: not the {schema.what} eyas writes")
    problem = check_fields(data, schema.fields, "")
    if problem:
        raise error(f"{path}: {problem}; {fix}")
    return data


def check_fields(data: dict[str, Any], fields: tuple[Field, ...], where: str) -> str | None:
    """The first field of `data` that does not fit `fields`, as "'key' should be ..., found ..."; None if all do."""
    for f in fields:
        name = f"{where}{f.key}"
        if f.key not in data:
            if f.required:
                return f"{name!r} should be {f.describe()}, found nothing"
            continue
        v = data[f.key]
        if v is None and f.nullable:
            continue
        # bool is an int in Python, never in these files
        fits = isinstance(v, KINDS[f.kind]) and (f.kind == "bool" or not isinstance(v, bool))
        if fits and f.low is not None and not f.low <= v < float("inf"):
            fits = False
        if not fits:
            shown = "null" if v is None else repr(v) if isinstance(v, (int, float, str)) else f"a {type(v).__name__}"
            return f"{name!r} should be {f.describe()}, found {shown[:60]}"
        if f.fields:
            problem = check_fields(v, f.fields, f"{name}.")
            if problem:
                return problem
        for i, e in enumerate(v if f.entries else ()):
            if not isinstance(e, dict):
                return f"'{name}[{i}]' should be a JSON object, found {str(e)[:40]!r}"
            problem = check_fields(e, f.entries, f"{name}[{i}].")
            if problem:
                return problem
    return None
