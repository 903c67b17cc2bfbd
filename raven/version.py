"""This build's release and the tunnel protocol versions it speaks, and how a peer's announced release reads.

Agents announce their release in HELLO and gateways in WELCOME from 0.2.0 on; a peer that announces nothing is
of release 0.1.0 (the only release before announcing began). Which releases serve which: docs/skew.md.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from raven import __version__, build
from raven.protocol import wire

RELEASE = __version__
UNANNOUNCED = "0.1.0"  # what a peer that announces no release runs (announcing began with 0.2.0)


def protocols(versions: tuple[int, ...] = wire.SUPPORTED_VERSIONS) -> str:
    """The protocol versions as one label value: ``1,2``."""
    return ",".join(str(v) for v in sorted(versions))


def describe() -> str:
    """What ``raven --version`` prints."""
    return f"raven {RELEASE} (tunnel protocol {protocols()}; {build.running()} build)"


def peer_release(announced: str) -> str:
    """A peer's release for people: the announced one, or what an unannounced one means."""
    return announced or f"{UNANNOUNCED} or older (not announced)"


def parse(release: str) -> Version | None:
    """The announced release as a comparable version (an unannounced one is 0.1.0); None if it is not one."""
    try:
        return Version(release or UNANNOUNCED)
    except InvalidVersion:
        return None


def older_than(announced: str, floor: str) -> bool:
    """Whether a peer's announced release is below ``floor`` (a release that is no version counts as below)."""
    have, want = parse(announced), parse(floor)
    if want is None:
        raise ValueError(f"{floor!r} is not a release version")
    return have is None or have < want
