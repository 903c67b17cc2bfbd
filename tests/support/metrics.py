"""Read one metric family from a service's /metrics, the way the tests check counters and gauges."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


async def metric_values(port: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out
