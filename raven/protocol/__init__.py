"""The tunnel protocol's contract, free of I/O: what crosses the tunnel and how (see docs/protocol.md).

This package is where the sans-I/O core grows (issue 11); for now it holds the HTTP side of the contract.
"""
