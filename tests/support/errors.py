"""The testbeds' own error (tests/support/testbed.py, l3testbed.py, linkbed.py): not part of the product's
hierarchy (raven/errors.py), since no product code raises or catches it."""

from __future__ import annotations


class TestbedError(RuntimeError):
    """The network-namespace testbed cannot run here (not root, a package missing, a command failed)."""

    __test__ = False  # not a pytest test class
