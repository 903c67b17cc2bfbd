"""Names as Raven takes them, outside the protocol core: RFC 1123 labels and host names, lower case (Kubernetes'
node names), and the settings types that hold node and pool names.

The protocol core checks the names its frames carry with the same rule (``wire.valid_node_name``,
``wire.valid_pool_name``); it keeps its own copy because it imports nothing outside itself. Here the label is
written once as a pattern, for whoever checks many names with one regular expression (raven/dns/hosts.py), and as a
check of one label (certificates: raven/pki/authority.py; pool names in the settings).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from raven.protocol import wire

# One RFC 1123 label, lower case: 1..63 of [a-z0-9-], not starting or ending with '-'. Possessive quantifiers: a
# label cannot backtrack past its delimiter, so a pattern of many names joined by newlines runs in linear time.
LABEL = r"[a-z0-9](?:[a-z0-9-]{0,62}+(?<=[a-z0-9]))?+"
MAX_NAME = 253  # characters of a host name (RFC 1123)
_LABEL = re.compile(LABEL)


def valid_label(value: str) -> bool:
    """One RFC 1123 label, lower case, at most 63 characters."""
    return _LABEL.fullmatch(value) is not None


def _node_name(value: str) -> str:
    if not wire.valid_node_name(value):
        raise ValueError(f"{value!r} is not a valid node name (RFC 1123: lower-case letters, digits, '-', '.')")
    return value


def _pool_name(value: str) -> str:
    if not valid_label(value):
        raise ValueError(f"{value!r} is not a valid pool name (an RFC 1123 label)")
    return value


NodeName = Annotated[str, AfterValidator(_node_name)]
PoolName = Annotated[str, AfterValidator(_pool_name)]
