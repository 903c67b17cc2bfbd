"""Layer 3's errors, in the project's one hierarchy (:class:`raven.errors.RavenError`)."""

from __future__ import annotations

from raven.errors import RavenError


class Layer3Error(RavenError):
    """A device, route, rule or sysctl cannot be set up or removed; the message names it and says why."""
