"""Reading a config document as verl reads it: Hydra `+key`s and dotted keys, `${...}`
interpolations, unknown keys (with the nearest known name), YAML bounded against alias bombs.

Every problem is collected before anything is reported, so `proctor check-config` lists them
all at once.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from proctor.server.config.schema import ConfigBlock, ConfigError, InferenceConfig, ProctorConfig

if typing.TYPE_CHECKING:
    pass



# Reading: Hydra-style keys, interpolations, unknown keys
# ------------------------------------------------------------------------------------------

_OPAQUE = ("engine_kwargs", "global_batch_info", "custom")  # user dicts: keys are not config paths


def normalize(node: Any, *, opaque: bool = False) -> Any:
    """Strip Hydra's `+`/`++` from keys and expand dotted keys (`a.b: 1` -> `a: {b: 1}`)."""
    if isinstance(node, list):
        return [normalize(v, opaque=opaque) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for raw_key, value in node.items():
        key = str(raw_key).lstrip("+") if not opaque else str(raw_key)
        parts = key.split(".") if not opaque else [key]
        value = normalize(value, opaque=opaque or parts[-1] in _OPAQUE)
        for part in reversed(parts[1:]):
            value = {part: value}
        _merge(out, parts[0], value)
    return out


def _merge(target: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(target.get(key), dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge(target[key], k, v)
    else:
        target[key] = value


_INTERPOLATION = re.compile(r"^\$\{(?:(oc\.select|oc\.env):)?([^,}]+)(?:,([^}]*))?\}$")
_MISSING = object()


def resolve_interpolations(root: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Resolve whole-value `${a.b}`, `${oc.select:a.b[,default]}` and `${oc.env:VAR[,default]}`.

    An `oc.select` whose path is absent is dropped, so the field takes its default (what verl's
    YAML means when, say, no `actor_rollout_ref.rollout.prompt_length` is around to copy).
    """

    def lookup(path: str) -> Any:
        node: Any = root
        for part in path.strip().split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def resolve(value: Any, where: str, depth: int = 0) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                r = resolve(v, f"{where}.{k}" if where else k, depth)
                if r is not _MISSING:
                    out[k] = r
            return out
        if isinstance(value, list):
            return [resolve(v, where, depth) for v in value]
        match = _INTERPOLATION.match(value) if isinstance(value, str) else None
        if match is None:
            return value
        if depth > 8:
            problems.append(f"{where}: interpolation {value!r} is circular")
            return _MISSING
        resolver, path, default = match.groups()
        if resolver == "oc.env":
            found = os.environ.get(path.strip(), _MISSING)
            if found is _MISSING and default is None:
                problems.append(f"{where}: environment variable {path.strip()} is not set (from {value!r})")
        else:
            found = lookup(path)
        if found is _MISSING and default is not None:
            found = yaml.safe_load(default) if default.strip() else None
        if found is _MISSING:
            if resolver is None:
                problems.append(f"{where}: interpolation {value!r} points at nothing in this file")
            return _MISSING
        return resolve(found, where, depth + 1)

    return resolve(root, "")


def _field_model(annotation: Any) -> tuple[str, type[ConfigBlock]] | None:
    """("model", M) for a block field, ("dict", M) for dict[str, M], else None."""
    if isinstance(annotation, type) and issubclass(annotation, ConfigBlock):
        return "model", annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and len(args) == 2:
        inner = _field_model(args[1])
        return ("dict", inner[1]) if inner and inner[0] == "model" else None
    for arg in args:  # Optional[...] / unions
        inner = _field_model(arg)
        if inner is not None:
            return inner
    return None


def _unknown_keys(model: type[ConfigBlock], data: Any, path: str, extra: frozenset[str] = frozenset()) -> list[str]:
    """Every key of `data` (and of its sub-blocks) that `model` neither declares nor accepts
    (nor `extra`), each with the nearest known name: the one unknown-key rule."""
    if not isinstance(data, dict):
        return []
    problems = []
    known = set(model.model_fields) | set(model.accepted) | set(extra)
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        field_info = model.model_fields.get(key)
        if field_info is None:
            if key not in model.accepted and key not in extra:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
                hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(model.model_fields))})"
                problems.append(f"{where}: unknown key{hint}")
            continue
        sub = _field_model(field_info.annotation)
        if sub is None:
            continue
        kind, sub_model = sub
        if kind == "model":
            problems += _unknown_keys(sub_model, value, where)
        elif isinstance(value, dict):
            for name, item in value.items():
                problems += _unknown_keys(sub_model, item, f"{where}.{name}")
    return problems


def inference_flag_problems(settings: dict[str, Any]) -> list[str]:
    """`proctor serve --inference KEY=VALUE` keys checked by the config file's rule (unknown keys
    with the nearest name), plus the keys only the command line takes."""
    return _unknown_keys(InferenceConfig, settings, "inference", InferenceConfig.command_line_only)


def _pydantic_problems(error: ValidationError) -> list[str]:
    out = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        got = item.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        out.append(f"{where}: {item['msg']}{shown}")
    return out


def parse_config(data: Any) -> tuple[ProctorConfig | None, list[str], list[str]]:
    """Validate a loaded document: (config or None when it does not validate, problems, ignored sections).

    Unknown keys are problems but do not stop validation, so that they are reported together
    with whatever the rest of the file gets wrong.
    """
    if not isinstance(data, dict):
        return None, ["the file must be a YAML mapping with a `distillation:` block"], []
    problems: list[str] = []
    data = resolve_interpolations(normalize(data), problems)
    ignored = sorted(k for k in data if k not in ProctorConfig.model_fields)
    if "distillation" not in data:
        problems.append("distillation: missing; put verl's `distillation:` block (teacher_models, ...) in the file")
    body = {k: v for k, v in data.items() if k in ProctorConfig.model_fields}
    problems += _unknown_keys(ProctorConfig, body, "")
    try:
        return ProctorConfig.model_validate(body), problems, ignored
    except ValidationError as exc:
        problems += [p for p in _pydantic_problems(exc) if not p.startswith("distillation: Field required")]
        return None, problems, ignored


class _YamlRefused(yaml.composer.ComposerError):
    """A document _BoundedYamlLoader will not compose (too deep, too large, self-referring)."""

    def __init__(self, problem: str, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"refused: {problem}", mark)


class _BoundedYamlLoader(yaml.SafeLoader):
    """A SafeLoader that refuses, while composing, documents nested deeper than MAX_DEPTH or
    larger than MAX_NODES once every alias is expanded: a few lines of aliases ("billion
    laughs") stand for billions of nodes that validation and hashing would walk, and deep
    nesting exhausts the recursive composer. Sizes are counted per node and reused, so the
    count itself stays linear in the text."""

    MAX_DEPTH = 64
    MAX_NODES = 100_000

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> nodes in its expansion
        self._open: list[int] = [0]  # nodes so far below each node being composed

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:
                raise _YamlRefused("an alias refers to its own ancestor", mark)
        else:
            if len(self._open) > self.MAX_DEPTH:
                raise _YamlRefused(f"nested deeper than {self.MAX_DEPTH} levels", mark)
            self._open.append(0)
            node = super().compose_node(parent, index)
            size = 1 + self._open.pop()
            self._sizes[id(node)] = size
        self._open[-1] += size
        if sum(self._open) > self.MAX_NODES:
            raise _YamlRefused(f"more than {self.MAX_NODES} nodes once aliases are expanded", mark)
        return node


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The document in `path`; ConfigError naming the file (and the line of a YAML error)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not a text file ({exc.reason} at byte {exc.start})"]) from None
    loader = _BoundedYamlLoader(text)
    loader.name = str(path)  # PyYAML's marks name "<unicode string>" for text it was handed
    try:
        return loader.get_single_data() or {}
    except _YamlRefused as exc:
        raise ConfigError([f"{_where(path, exc.problem_mark)}: {exc.problem}"]) from None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError([yaml_problem(path, exc)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML ({exc})"]) from None
    finally:
        loader.dispose()


def yaml_problem(path: str | Path, exc: yaml.MarkedYAMLError) -> str:
    """One line for a YAML error: the file, the line and column (1-based), what is wrong, and
    the construct it was inside (PyYAML's own text spans several lines with a caret picture)."""
    problem = exc.problem or "cannot be read"
    context = ""
    if exc.context:
        at = f" started at line {exc.context_mark.line + 1}" if exc.context_mark else ""
        context = f" ({exc.context}{at})"
    return f"{_where(path, exc.problem_mark or exc.context_mark)}: not valid YAML: {problem}{context}"


def _where(path: str | Path, mark: yaml.Mark | None) -> str:
    """`path, line L, column C` (1-based, as editors count), or the path alone."""
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
