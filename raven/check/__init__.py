"""``raven check``'s work: read the cluster and the gateways' ops API (reader.py), judge (checks.py, dnsprobe.py,
clock.py, prom.py, descriptors.py; pre.py for ``--pre``), show (results.py). The command line is raven/cli/check.py.
"""
