"""One reader for eyas's metadata files: a shard folder's manifest.json, a draft's or checkpoint's
eyas_manifest.json, an export's, an n-gram table's and a replay-rows folder's eyas_manifest.json, a checkpoint's
trainer_state.json, a draft folder's config.json (the file SGLang and vLLM read) and a recipe's latest-train.json.

Each file has a `Schema` (the language is eyas/schema.py): every field eyas writes there, with its JSON type,
bounds, nested fields and array entries, and every path in it a file inside the file's own folder. `read_metadata`
parses the file and checks it against its schema, so a damaged or hostile file (not JSON, empty, a field missing,
of the wrong type, out of range, a path out of the folder) is one error naming the file, the field and the fix,
never a KeyError or TypeError deep in a reader. Fields eyas writes only as a record for people (a recipe's
settings, library versions) are checked as records of plain values. What a value means for one run (a step past
the run's last, a layout other than the data's) is the caller's check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import EyasError
from .schema import INT_MAX, Field, Schema, check_schema, schema_markdown

# generous ceilings: beyond them a value is damage, whatever model it claims to describe
DIM = 1 << 20  # a hidden, head or MLP width
LAYERS = 1 << 12  # decoder layers, and so stream indices
VOCAB = 2**31 - 1  # token ids are stored as int32
DIGEST = r"(xxh3_128:[0-9a-f]{32}|sha256:[0-9a-f]{64})"
HASH = r"sha256:[0-9a-f]{8,64}"


def whole(key: str, low: int | None = 0, high: int = INT_MAX, required: bool = False,
          nullable: bool = False) -> Field:
    return Field(key, "int", required=required, low=low, high=high, nullable=nullable)


def num(key: str, low: float | None = 0, high: float | None = None, required: bool = False,
        nullable: bool = False) -> Field:
    return Field(key, "number", required=required, low=low, high=high, nullable=nullable)


def text(key: str, required: bool = False, nullable: bool = False, choices: tuple[str, ...] = (),
         pattern: str | None = None) -> Field:
    return Field(key, "string", required=required, nullable=nullable, choices=choices, pattern=pattern)


def flag(key: str, required: bool = False, nullable: bool = False) -> Field:
    return Field(key, "bool", required=required, nullable=nullable)


def obj(key: str, *fields: Field, required: bool = False, nullable: bool = False, each: Field | None = None,
        file_keys: bool = False) -> Field:
    return Field(key, "object", required=required, nullable=nullable, fields=fields, each=each, file_keys=file_keys)


def arr(key: str, each: Field | None = None, required: bool = False, nullable: bool = False,
        entries: tuple[Field, ...] = (), size: int | None = None) -> Field:
    return Field(key, "array", required=required, nullable=nullable, each=each, entries=entries, low=size, high=size)


def ints(key: str, low: int = 0, high: int = INT_MAX, required: bool = False, nullable: bool = False,
         size: int | None = None) -> Field:
    return arr(key, Field("", "int", low=low, high=high), required=required, nullable=nullable, size=size)


def strings(key: str, required: bool = False, nullable: bool = False) -> Field:
    return arr(key, Field("", "string"), required=required, nullable=nullable)


def numbers(key: str, low: float = 0, high: float | None = None, nullable: bool = False) -> Field:
    return arr(key, Field("", "number", low=low, high=high, nullable=True), nullable=nullable)


def record(key: str, nullable: bool = True) -> Field:
    """A record for people (a recipe's settings, an engine's arguments): plain values, no structure eyas reads."""
    return Field(key, "object", required=False, nullable=nullable, each=Field("", "value", nullable=True))


FORMAT_VERSION = whole("format_version", low=1, high=1)
IDENTITY = (text("architecture", required=True), text("model_type", required=True),
            whole("num_layers", 1, LAYERS, required=True), whole("hidden_size", 1, DIM, required=True),
            whole("vocab_size", 1, VOCAB, required=True), text("fingerprint", required=True), text("name"))
LAYOUT_FIELDS = (ints("aux_indices", 0, LAYERS, required=True), text("convention"), flag("capture_final"),
                 obj("target", *IDENTITY, nullable=True),
                 obj("norms", each=Field("", "number", low=0)))
LAYOUT = obj("layout", *LAYOUT_FIELDS, required=True)
TEMPLATE = obj("chat_template", text("source", required=True, choices=("tokenizer", "builtin", "file", "raw")),
               text("name", nullable=True), text("sha256", nullable=True), nullable=True)
# the size and digest of each tensor file, keyed by its name in the folder
FILES = obj("files", file_keys=True, each=obj("", whole("bytes"), text("digest", pattern=DIGEST),
                                              text("sha256", pattern=r"[0-9a-f]{64}")), nullable=True)
COMMANDS = strings("commands")
VERSIONS = obj("versions", each=text(""))

# the draft module's shape (eyas.draft.DraftConfig), in a draft's, a checkpoint's and an export's manifest
DRAFT_SHAPE = obj("draft_config", *(whole(k, 1, DIM, required=True) for k in (
    "hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size")), whole("vocab_size", 1, VOCAB, required=True),
    whole("draft_vocab_size", 1, VOCAB, required=True), whole("num_aux", 1, LAYERS),
    num("rms_norm_eps", 0, 1), num("rope_theta", 1e-9), whole("max_position_embeddings", 1),
    text("hidden_act", choices=("silu",)), flag("fc_norm"), required=True)

# datagen's settings (a shard manifest's `config`; a draft manifest's data.config(s) copies them)
DATAGEN_CONFIG = (
    text("source"), text("source_fingerprint"), whole("start_row"), whole("max_len", 1), flag("regenerate"),
    num("temperature"), num("top_p", 0, 1), Field("seed", "int", required=False),
    whole("max_new_tokens", 1), whole("max_turns", 1, nullable=True), whole("repetition_limit", nullable=True),
    text("dtype"), text("target_dtype"), whole("num", nullable=True), whole("shard_samples", 1),
    whole("shard_tokens", 1), whole("threads"), text("regen_weights"), text("regen_engine", nullable=True),
    text("engine"),
    obj("vllm", text("version", nullable=True), text("python"), text("device"), text("generator"),
        ints("aux_ids", 0, LAYERS), record("engine_args")))
COUNTS = obj("counts", *(whole(k) for k in (
    "rows", "conversations", "samples", "tokens", "loss_tokens", "truncated", "bytes", "regenerated_replies",
    "regenerated_tokens", "finish_eos", "finish_repetition", "finish_length")), num("seconds"),
    each=Field("", "number", low=0))
SKIPPED = obj("skipped", each=whole(""))
NORM_SUMS = obj("norm_sums", each=Field("", "number", low=0))
SHARD_ENTRY = (Field("file", "file"), whole("samples", 1, required=True), whole("tokens", 1, required=True),
               whole("loss_tokens"), ints("row_ids", size=2), whole("bytes"), text("digest", pattern=DIGEST),
               text("sha256", pattern=r"[0-9a-f]{64}"))
COMMIT = (whole("shards", required=True), whole("watermark", -1, required=True),
          obj("counts", each=Field("", "number", low=0), required=True),
          obj("skipped", each=whole(""), required=True), obj("norm_sums", each=Field("", "number", low=0),
                                                             required=True),
          whole("norm_tokens", required=True), obj("norms", each=Field("", "number", low=0), required=True))


def _shard_rules(m: dict[str, Any]) -> str | None:
    """What each shard entry and the watermark claim, against each other: cheap bounds that catch an edited count
    before a reader trusts it (the tensors themselves are compared when a reader opens the shard)."""
    seen: set[str] = set()
    for i, e in enumerate(m["shards"]):
        at = f"shards[{i}]"
        if e["file"] in seen:
            return f"'{at}.file' names {e['file']!r} a second time; each shard is listed once"
        seen.add(e["file"])
        if e["samples"] > e["tokens"]:
            return f"'{at}.samples' is {e['samples']}, more than its {e['tokens']} tokens"
        if e.get("loss_tokens", 0) > e["tokens"]:
            return f"'{at}.loss_tokens' is {e['loss_tokens']}, more than its {e['tokens']} tokens"
        if "bytes" in e and 5 * e["tokens"] + 16 * e["samples"] > e["bytes"]:  # int32 id + mask byte per token
            return (f"'{at}.tokens' is {e['tokens']}, more than a {e['bytes']}-byte shard can hold (each token "
                    "takes at least 5 bytes)")
        rows = e.get("row_ids")
        if rows and rows[0] > rows[1]:
            return f"'{at}.row_ids' is {rows}, expected [first, last] with first <= last"
    if "watermark" in m:
        last = max((e["row_ids"][1] for e in m["shards"] if e.get("row_ids")), default=-1)
        if m["watermark"] < last:
            return f"'watermark' is {m['watermark']}, before row {last} that a listed shard holds"
        rows = (m.get("counts") or {}).get("rows")
        start = (m.get("config") or {}).get("start_row", 0)
        if rows is not None and m["watermark"] > start - 1 + rows:
            return (f"'watermark' is {m['watermark']}, past the {rows} source rows read from row {start} "
                    f"(at most {start - 1 + rows})")
    return None


SHARD_MANIFEST = Schema("shard manifest", (
    text("kind", required=True), Field("format_version", "int", low=1), LAYOUT,
    arr("shards", required=True, entries=SHARD_ENTRY), obj("config", *DATAGEN_CONFIG), COUNTS, SKIPPED,
    obj("skipped_rows", each=ints("")), COMMANDS,
    whole("watermark", -1), flag("complete"), NORM_SUMS, whole("norm_tokens"),
    arr("commits", entries=COMMIT), TEMPLATE, obj("target", *IDENTITY), text("target_source", nullable=True),
    VERSIONS), rules=(_shard_rules,))

# the training options (eyas.train.config.TrainConfig) a draft's `training` and a trainer state's `config` copy
TRAIN_CONFIG = (
    strings("data"), text("out"), text("target", nullable=True), flag("online"), whole("num_samples", 1, nullable=True),
    ints("data_tokens", nullable=True), ints("aux_indices", 0, LAYERS, nullable=True), whole("draft_vocab", 1),
    whole("ttt_steps", 1), num("epochs", nullable=True), whole("max_steps", nullable=True),
    num("max_time", nullable=True), num("lr"), num("warmup_ratio", 0, 1), num("min_lr_ratio", 0, 1),
    num("weight_decay"), num("grad_clip", nullable=True), whole("batch_tokens", 1), whole("max_len", 1),
    flag("bf16", nullable=True), Field("seed", "int", required=False), whole("eval_every"), whole("save_every"),
    num("heldout_pct", 0, 100), whole("eval_samples"), whole("replay_k"), whole("replay_samples"),
    whole("intermediate_size", 1, DIM, nullable=True), text("fc_init"), flag("fc_norm"),
    text("init_from", nullable=True), flag("refresh_vocab"), text("device"), text("target_dtype"), flag("resume"),
    whole("buffer_mb"), flag("quiet"), whole("threads"), text("chat_template", nullable=True), flag("raw"))
METRICS = obj("metrics", whole("step"), whole("epoch"), whole("tokens_seen"), num("train_loss", nullable=True),
              whole("train_loss_steps"), numbers("train_acc", 0, 1), numbers("heldout_loss"),
              numbers("heldout_acc", 0, 1), ints("heldout_rows"), num("simulated_tau", nullable=True),
              whole("replay_k"), num("replay_tau", nullable=True), ints("replay_per_pos"), whole("replay_drafts"),
              whole("replay_rows"), num("tokens_per_s"), num("lr"), num("elapsed_s"), nullable=True)
DRAFT_VOCAB = (whole("size", 1, VOCAB), whole("requested_size", 1), text("hash", required=True, pattern=HASH),
               text("source_dataset_hash"), num("coverage", 0, 1), whole("counted_tokens"),
               ints("always_included", 0, VOCAB), whole("target_vocab_size", 1, VOCAB))
DATA = (text("kind", choices=("shards", "online")), strings("folders"), text("hash", pattern=HASH),
        ints("data_tokens", nullable=True), ints("kept_tokens", nullable=True), text("target_source", nullable=True),
        obj("config", *DATAGEN_CONFIG, nullable=True), arr("configs", obj("", *DATAGEN_CONFIG, nullable=True)),
        ints("folder_tokens"), whole("train_samples"), whole("heldout_samples"), text("source"), SKIPPED)
LINEAGE = (text("draft"), text("data_hash", nullable=True), whole("tokens_seen", nullable=True),
           whole("steps", nullable=True), num("training_time_s", nullable=True), text("command", nullable=True),
           numbers("heldout_acc", 0, 1, nullable=True), text("eyas_version"), text("shipped"), text("data_rows"))
IMPORT = obj("import", text("format"), text("format_detected_by"), text("decided_by", nullable=True),
             ints("aux_indices", 0, LAYERS), strings("notes"), strings("warnings"),
             obj("readings", each=ints("")), flag("ambiguous", nullable=True),
             obj("ids_found", nullable=True), obj("inference", nullable=True))
_DRAFT_FIELDS = (
    text("kind", required=True), FORMAT_VERSION, LAYOUT, DRAFT_SHAPE, FILES,
    whole("step"), whole("total_steps"), whole("tokens_seen"), METRICS, obj("target", *IDENTITY, text("source")),
    TEMPLATE, obj("draft_vocab", *DRAFT_VOCAB), obj("training", *TRAIN_CONFIG, num("feature_norm", nullable=True)),
    obj("data", *DATA), num("training_time_s"), text("command"), whole("world_size", 1), VERSIONS,
    flag("untrained"), text("note"), text("target_source", nullable=True), IMPORT,
    obj("shipped", text("from"), text("at"), record("recipe"), text("dtype"), text("eyas_version"),
        text("data_rows")),
    arr("lineage", entries=LINEAGE), num("total_training_time_s"))


def _draft_rules(m: dict[str, Any]) -> str | None:
    c = m["draft_config"]
    if c["draft_vocab_size"] > c["vocab_size"]:
        return (f"'draft_config.draft_vocab_size' is {c['draft_vocab_size']}, more than the target vocab "
                f"draft_config.vocab_size {c['vocab_size']}")
    if c["num_attention_heads"] % c["num_key_value_heads"]:
        return (f"'draft_config.num_key_value_heads' is {c['num_key_value_heads']}, which does not divide "
                f"num_attention_heads {c['num_attention_heads']}")
    layout = m.get("layout")
    if layout is not None and "num_aux" in c and c["num_aux"] != len(layout["aux_indices"]):
        return (f"'draft_config.num_aux' is {c['num_aux']}, but layout.aux_indices lists "
                f"{len(layout['aux_indices'])} stream indices")
    return None


DRAFT_MANIFEST = Schema("draft manifest", _DRAFT_FIELDS, rules=(_draft_rules,))
# a checkpoint's manifest is a draft manifest that also records what resuming must match
CHECKPOINT_MANIFEST = Schema("checkpoint manifest", (
    *(f for f in _DRAFT_FIELDS if f.key not in ("step", "draft_vocab", "data")), whole("step", required=True),
    obj("draft_vocab", *DRAFT_VOCAB, required=True), obj("data", *DATA, required=True)), rules=(_draft_rules,))
EXPORT_MANIFEST = Schema("export manifest", (
    text("kind", required=True), FORMAT_VERSION, text("format", choices=("sglang", "vllm", "speculators")), FILES,
    obj("layout", *LAYOUT_FIELDS), obj("engine_ids", each=Field("", "value")),  # an engine's ids, or why it has none
    obj("ids_in_config", ints("eagle_aux_hidden_state_layer_ids", -1, LAYERS, nullable=True),
        ints("eagle_config.eagle_aux_hidden_state_layer_ids", -1, LAYERS, nullable=True),
        text("eagle_aux_layer_semantics", nullable=True)),
    obj("draft_config", *DRAFT_SHAPE.fields), text("dtype"), text("source_draft", nullable=True),
    text("source_manifest_sha256", nullable=True), text("target_source", nullable=True),
    ints("source_layout_order", 0, LAYERS, nullable=True), text("serving_target", nullable=True),
    obj("verifier", text("name_or_path", nullable=True), text("fingerprint", nullable=True),
        text("target_source", nullable=True), nullable=True),
    obj("launch", text("command"), whole("steps", 1), whole("topk", 1), whole("draft_tokens", 1, nullable=True)),
    obj("engine_versions", each=text("", nullable=True)), text("eyas_version"), COMMANDS))
TRAINER_STATE = Schema("trainer state", (
    *(whole(k, required=True) for k in ("step", "epoch", "batch_in_epoch", "tokens_seen")),
    num("train_time_s", required=True), whole("world_size", 1), obj("config", *TRAIN_CONFIG, required=True),
    obj("optimizer", arr("param_groups", required=True, entries=(
        num("lr"), numbers("betas", 0, 1), num("eps"), num("weight_decay"), ints("params"), flag("amsgrad"),
        flag("maximize"), flag("foreach", nullable=True), flag("capturable"), flag("differentiable"),
        flag("fused", nullable=True), flag("decoupled_weight_decay"))), required=True),
    FILES))
# the draft config engines read: foreign tools write other keys and null for unknowns, so nothing is required,
# but a size that is there is a positive whole number and the id lists are lists of stream or layer ids
_SIZES = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "num_hidden_layers", "max_position_embeddings")
DRAFT_CONFIG = Schema("draft config", (
    arr("architectures", text(""), nullable=True), text("model_type", nullable=True),
    *(whole(k, 1, DIM, nullable=True) for k in _SIZES),
    *(whole(k, 1, VOCAB, nullable=True) for k in ("vocab_size", "draft_vocab_size")),
    num("rms_norm_eps", 0, 1, nullable=True), num("rope_theta", 1e-9, nullable=True),
    text("hidden_act", nullable=True), flag("tie_word_embeddings", nullable=True), text("torch_dtype", nullable=True),
    text("dtype", nullable=True), record("rope_scaling"), record("rope_parameters"), flag("fc_norm", nullable=True),
    flag("norm_before_residual", nullable=True),
    obj("eagle_config", Field("eagle_aux_hidden_state_layer_ids", "array", required=False, nullable=True,
                              each=Field("", "int", low=-1, high=LAYERS)),
        flag("use_aux_hidden_state", nullable=True), nullable=True),
    Field("eagle_aux_hidden_state_layer_ids", "array", required=False, nullable=True,
          each=Field("", "int", low=-1, high=LAYERS)),
    text("eagle_aux_layer_semantics", nullable=True)))
NGRAM_MANIFEST = Schema("n-gram table manifest", (
    text("kind", required=True), whole("format_version", required=True), obj("target", *IDENTITY),
    obj("config", whole("order", 1, 64, required=True), whole("min_count", 1), strings("data"), text("out"),
        required=True),
    arr("sources", entries=(text("folder"), flag("regenerated"), whole("samples"), whole("tokens"))),
    text("data_hash", pattern=HASH), whole("reply_tokens"), text("command"), num("seconds"),
    obj("entries", each=whole("")), text("data_rows"), text("eyas_version"), FILES))
REPLAY_MANIFEST = Schema("replay rows manifest", (
    text("kind", required=True), FORMAT_VERSION, whole("rows"), ints("streams", 0, LAYERS, required=True),
    whole("max_new_tokens", 1, required=True), ints("eos", 0, VOCAB, required=True),
    obj("target", *IDENTITY, required=True), text("numerics"), record("source"),
    Field("files", "object", file_keys=True, each=FILES.each)))
# WORK/latest-train.json: the training run the recipe's later stages read, a folder inside WORK
LATEST_TRAIN = Schema("recipe record", (Field("train_dir", "file"), strings("data")))
# any eyas manifest, before its kind says which schema it has (inspect reads folders of every kind)
ANY_MANIFEST = Schema("eyas manifest", (text("kind", required=True),))
BY_KIND = {"eyas-shards": SHARD_MANIFEST, "eyas-draft": DRAFT_MANIFEST, "eyas-export": EXPORT_MANIFEST,
           "eyas-ngram": NGRAM_MANIFEST, "eyas-replay-rows": REPLAY_MANIFEST}
# every metadata file eyas reads, with where it lives (docs/CONTRACTS.md lists them in this order)
CONTRACT_TITLES = ((SHARD_MANIFEST, "DATA/manifest.json"), (DRAFT_MANIFEST, "DRAFT/eyas_manifest.json"),
                   (CHECKPOINT_MANIFEST, "CHECKPOINT/eyas_manifest.json"),
                   (TRAINER_STATE, "CHECKPOINT/trainer_state.json"), (EXPORT_MANIFEST, "EXPORT/eyas_manifest.json"),
                   (DRAFT_CONFIG, "DRAFT/config.json, EXPORT/config.json"),
                   (NGRAM_MANIFEST, "TABLE/eyas_manifest.json"), (REPLAY_MANIFEST, "ROWS/eyas_manifest.json"),
                   (LATEST_TRAIN, "WORK/latest-train.json"))
SCHEMAS = tuple(schema for schema, _ in CONTRACT_TITLES)


def read_metadata(path: str | Path, schema: Schema, error: type[EyasError], fix: str,
                  kind: str | None = None) -> dict[str, Any]:
    """The JSON object in `path`, checked against `schema` (paths in it: files inside path's folder); anything
    else raises `error` naming the file, the field and `fix`. kind: the "kind" the file must declare, checked
    first (another tool's file of the same name is named as such, not as a damaged one)."""
    path = Path(path)
    try:
        text_ = path.read_text()
    except UnicodeDecodeError as e:
        raise error(f"{path} is not valid JSON (not UTF-8 text: {e.reason}); {fix}") from e
    if not text_.strip():
        raise error(f"{path} is empty, expected the {schema.what} (an interrupted write?); {fix}")
    try:
        data = json.loads(text_)
    except (json.JSONDecodeError, RecursionError) as e:
        raise error(f"{path} is not valid JSON ({str(e)[:200]}); {fix}") from e
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, expected the {schema.what} as an object; {fix}")
    if kind is not None and data.get("kind") != kind:
        raise error(f"{path}: kind {data.get('kind')!r}, expected {kind!r}: not the {schema.what} eyas writes")
    problem = check_schema(data, schema, path.parent)
    if problem:
        raise error(f"{path}: {problem}; {fix}")
    return data


BEGIN = ("<!-- metadata tables: generated from eyas/metadata.py by `make contracts`; edit the schemas, not these "
         "tables -->")
END = "<!-- end of metadata tables -->"


def contracts_section() -> str:
    """Every metadata file's fields as docs/CONTRACTS.md lists them, generated from the schemas above."""
    return "\n\n".join([BEGIN, *(schema_markdown(s, title) for s, title in CONTRACT_TITLES), END])
