"""Read one metric family from a service's /metrics, the way the tests check counters and gauges."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


def parse_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def metric_values(port: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    return {labels: value for (sample, labels), value in parse_samples(text).items() if sample == name}
