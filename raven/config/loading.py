"""Loading a configuration: the YAML file, then ``RAVEN_*`` environment variables, then ``--set`` and flags;
an invalid one fails with one line per problem naming the field (an unknown one: its section and the nearest
setting, ``raven.unknownkeys``).

Environment variables: ``RAVEN_<FIELD>``, nested with ``__``. One whose first part names no setting is not
configuration (``RAVEN_NO_UVLOOP``, a Kubernetes Service's ``RAVEN_GATEWAY_SERVICE_HOST``) and is ignored, with a
warning when it is close to a setting's name; one that names a section but no setting in it is refused, as an
unknown key in the file is, naming the variable.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raven.config.agent import AgentConfig
from raven.config.gateway import GatewayConfig
from raven.errors import ConfigError
from raven.unknownkeys import EXTRA, unknown_setting

log = logging.getLogger("raven.config")

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


def _format_errors(err: ValidationError, source: str, model: type[GatewayConfig] | type[AgentConfig],
                   from_env: Mapping[str, str]) -> str:
    """One line per problem, naming the field; ``from_env`` maps a dotted path to the variable that set it."""
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == EXTRA:  # a typo: its section and the nearest setting, not pydantic's "Extra inputs"
            msg = unknown_setting(model, e["loc"])
            if loc in from_env:
                msg += f" (set by {from_env[loc]})"
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")  # model-level messages name their field
    return "\n".join(lines)


def _resolve(root: Path, value: str) -> str:
    """A file named relative to the configuration file's folder, as one normalised absolute path (a copied
    example's ``../../certs/x.pem`` is reported as the file it names, not as ``/tmp/../../certs/x.pem``)."""
    return os.path.abspath(os.path.join(root, value))


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
                        section[name] = _resolve(root, value)
        auth = front.get("auth")
        if isinstance(auth, dict) and isinstance(auth.get("token_files"), list):
            auth["token_files"] = [_resolve(root, f) if isinstance(f, str) and not os.path.isabs(f) else f
                                   for f in auth["token_files"]]
    env = os.environ if environ is None else environ
    from_env: dict[str, str] = {}  # dotted path -> the variable that set it
    for key, value in sorted(env.items()):
        if key.startswith("RAVEN_"):
            dotted = key.removeprefix("RAVEN_").lower().replace("__", ".")
            top = dotted.split(".")[0]
            # Only variables that name a setting: RAVEN_NO_UVLOOP and the like are not configuration.
            if top in model.model_fields:
                _set_path(tree, dotted, _scalar(value))
                from_env[".".join(p for p in dotted.split(".") if p)] = key
            else:
                near = difflib.get_close_matches(top, list(model.model_fields), n=1, cutoff=0.8)
                if near:  # most likely a typo of a setting; still not configuration, so not refused
                    log.warning("environment variable %s names no setting and is ignored; did you mean RAVEN_%s?",
                                key[:80], near[0].upper())
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
            sources.append("environment " + ", ".join(sorted(from_env.values())))
        if overrides:
            sources.append("flags")
        raise ConfigError(_format_errors(err, "; ".join(sources) or "defaults", model, from_env)) from None
