"""Loading a configuration: the YAML file, then ``RAVEN_*`` environment variables, then ``--set`` and flags;
an invalid one fails with one line per problem naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raven.config.agent import AgentConfig
from raven.config.gateway import GatewayConfig
from raven.errors import ConfigError

# ---------------------------------------------------------------- loading


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty field path in {dotted!r}")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _scalar(text: str) -> Any:
    """Parse an override value as YAML, so that ``9400`` is a number and ``[1, 2]`` a list."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")  # model-level messages name their field
    return "\n".join(lines)


def load_tree(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return tree


def build(
    model: type[GatewayConfig] | type[AgentConfig],
    path: Path | None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    base_dir: Path | None = None,
) -> Any:
    """Load a config: file, then ``RAVEN_*`` environment, then ``field.path=value`` overrides."""
    tree = load_tree(path)
    # Relative file paths in a file (TLS, front-end TLS and token files) are relative to the file's folder;
    # in flags, to the cwd.
    root = base_dir or (path.parent if path is not None else None)
    if root is not None:
        front = tree.get("front")
        front = front if isinstance(front, dict) else {}
        for section in (tree.get("tls"), front.get("tls")):
            if isinstance(section, dict):
                for name in ("cert", "key", "ca"):
                    value = section.get(name)
                    if isinstance(value, str) and not os.path.isabs(value):
                        section[name] = str(root / value)
        auth = front.get("auth")
        if isinstance(auth, dict) and isinstance(auth.get("token_files"), list):
            auth["token_files"] = [str(root / f) if isinstance(f, str) and not os.path.isabs(f) else f
                                   for f in auth["token_files"]]
    env = os.environ if environ is None else environ
    from_env: list[str] = []
    for key, value in sorted(env.items()):
        if key.startswith("RAVEN_"):
            dotted = key.removeprefix("RAVEN_").lower().replace("__", ".")
            # Only variables that name a setting: RAVEN_NO_UVLOOP and the like are not configuration.
            if dotted.split(".")[0] in model.model_fields:
                _set_path(tree, dotted, _scalar(value))
                from_env.append(key)
    for item in overrides:
        field, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like field.path=value")
        _set_path(tree, field.strip(), _scalar(value))
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        sources = [str(path)] if path else []
        if from_env:
            sources.append("environment " + ", ".join(sorted(from_env)))
        if overrides:
            sources.append("flags")
        raise ConfigError(_format_errors(err, "; ".join(sources) or "defaults")) from None
