"""One error hierarchy for the whole project: every error a user acts on is a :class:`RavenError`.

Its message says what went wrong and what to do; ``exit_code`` is what ``raven`` exits with when one ends a
command (2: the command line or the configuration is wrong; 1: the work failed). The CLI catches
``RavenError`` (and ``OSError``, e.g. an address already in use) and prints one line, never a traceback.
Protocol-level errors (a malformed frame, a reset stream) are RavenErrors too, but are handled where they
happen and reach the user only as a logged reason or an HTTP status.
"""

from __future__ import annotations


class RavenError(Exception):
    """A problem with a message a user can act on."""

    exit_code = 1


# ---------------------------------------------------------------- the user's input (exit 2)


class ConfigError(RavenError):
    """A configuration problem a user can fix; the message names the field."""

    exit_code = 2


class UsageError(RavenError):
    """The command line is wrong."""

    exit_code = 2


# ---------------------------------------------------------------- the work failed (exit 1)


class CommandFailed(RavenError):
    """The command line is fine but the work failed, e.g. a server did not answer."""


class PKIError(RavenError):
    """A certificate operation failed; the message says what went wrong and how to fix it."""


class TLSError(RavenError):
    """Certificate or key files cannot be used for TLS; the message names the file."""


class KubeError(RavenError):
    """A Kubernetes operation failed; the message says what and where."""


class CheckError(RavenError, ValueError):
    """Bad input to ``raven dns check`` (a server or address that is not one)."""

    exit_code = 2
