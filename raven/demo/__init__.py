"""`raven demo` and what it runs on, also used by the tests and the benchmarks: the demo itself (``demo``), a
local cluster of real gateway and agent processes (``launch``) and a simulated dcgm-exporter (``simexporter``).
"""
