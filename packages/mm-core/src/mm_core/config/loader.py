"""Read the YAML, apply ``key=value`` overrides, validate, and explain failures in one line."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mm_core.config.schema import MMConfig
from mm_core.errors import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b.c=value`` into the dotted key and the value read as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. training.lr=3e-4")
    return key, _read_value(raw.strip())


def _read_value(raw: str) -> Any:
    """A value read as YAML; module patterns such as ``[model.layers.{*}]`` (not valid flow YAML because of
    the braces) are read as a list of strings, and other unparsable text as a plain string."""
    if not raw:
        return None
    try:
        return yaml.load(raw, Loader=UniqueKeyLoader)
    except _DuplicateKey as exc:
        raise ConfigError(f"override value {raw!r}: key {exc.key} is given twice") from None
    except yaml.YAMLError:
        if raw.startswith("[") and raw.endswith("]"):
            return [_read_value(item.strip()) for item in raw[1:-1].split(",") if item.strip()]
        return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` strings to the nested dict ``raw`` (in place) and return it."""
    for text in overrides:
        key, value = parse_override(text)
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {key}: {where} is {child!r}, not a block of keys")
            node = child
        node[parts[-1]] = value
    return raw


class _DuplicateKey(yaml.YAMLError):
    """A mapping gives the same key twice (PyYAML would silently keep the last one)."""

    def __init__(self, key: str, first_line: int, second_line: int) -> None:
        super().__init__(key)
        self.key, self.first_line, self.second_line = key, first_line, second_line


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key given twice, naming the dotted key and both lines.

    The check runs on the composed node tree, before construction, so the full dotted path is known; keys
    brought in by a merge (``<<: *anchor``) may still be overridden, as YAML intends."""

    def construct_document(self, node: yaml.Node) -> Any:
        _check_unique_keys(node, (), set())
        return super().construct_document(node)


def _check_unique_keys(node: yaml.Node, path: tuple[str, ...], seen: set[int]) -> None:
    if id(node) in seen:  # an alias to a node already checked (also stops recursive anchors)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if isinstance(key_node, yaml.ScalarNode):
                ident = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if ident in first:
                    raise _DuplicateKey(".".join([*path, key_node.value]), first[ident], line)
                first[ident] = line
                _check_unique_keys(value_node, (*path, key_node.value), seen)
            else:
                _check_unique_keys(value_node, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",), seen)


def _decode_utf8(data: bytes, path: Path) -> str:
    """The file's text; a file that is not UTF-8 is a ConfigError naming the line and byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}:{line}: not valid UTF-8 at byte offset {e.start} ({e.reason}); save the file as UTF-8"
        ) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file into a dict, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(_decode_utf8(path.read_bytes(), path), Loader=UniqueKeyLoader)
    except _DuplicateKey as exc:
        raise ConfigError(
            f"{path}:{exc.second_line}: key {exc.key} is given twice (lines {exc.first_line} and "
            f"{exc.second_line}); YAML would silently keep only the second, so merge them into one"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of blocks (parallel, data, model, ...)")
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> MMConfig:
    """Load, override and validate a config file. Raises :class:`ConfigError` with a one-line message."""
    raw = apply_overrides(read_yaml(path), list(overrides or []))
    return validate_config(raw, source=str(path))


def validate_config(raw: dict[str, Any], source: str = "config") -> MMConfig:
    """Validate a nested dict against :class:`MMConfig`."""
    try:
        return MMConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_error(exc, raw)}") from None


def _schema_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (its parent location)."""
    model: type[BaseModel] = MMConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        model = nxt
    return model


def _value_at(raw: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if (
            isinstance(raw, dict)
            and part in raw
            or isinstance(raw, list)
            and isinstance(part, int)
            and part < len(raw)
        ):
            raw = raw[part]
        else:
            return None
    return raw


def describe_error(exc: ValidationError, raw: dict[str, Any]) -> str:
    """One line for the first validation error: dotted key, bad value, what is accepted."""
    errors = exc.errors()
    err = errors[0]
    loc = _clean_loc(err["loc"], raw)
    key = ".".join(str(p) for p in loc) or "<top level>"
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _schema_at(loc)
        known = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""
        return f"{key}: unknown key{hint} (accepted here: {', '.join(known)})"
    if kind == "missing":
        return f"{key}: missing; this key is required"
    value = _value_at(raw, loc)
    # A union (e.g. ``int | 'auto'``) fails once per member: say what each member accepts.
    msgs: list[str] = []
    for other in errors:
        if _clean_loc(other["loc"], raw) == loc:
            msg = other["msg"].removeprefix("Value error, ")
            msg = msg[0].lower() + msg[1:]
            if msg not in msgs:
                msgs.append(msg)
    if isinstance(value, dict):  # a rule over several keys of a block: the message names them
        return f"{key}: {' or '.join(msgs)}"
    return f"{key}: got {value!r}; {' or '.join(msgs)}"


_UNION_TAGS = {"int", "str", "float", "bool", "none", "list", "dict"}


def _clean_loc(loc: tuple[Any, ...], raw: Any) -> tuple[Any, ...]:
    """Drop the union-member tags pydantic puts in error locations (``int``, ``literal['auto']``), walking
    the raw input alongside so that a real key spelled like a tag (``list``) is kept."""
    out: list[Any] = []
    node = raw
    for part in loc:
        if (
            isinstance(node, dict)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and part < len(node)
        ):
            node = node[part]
        elif isinstance(part, str) and ("[" in part or part in _UNION_TAGS):
            continue
        else:
            node = None
        out.append(part)
    return tuple(out)
