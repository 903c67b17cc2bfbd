"""A thin Kubernetes layer on kubernetes_asyncio: the node inventory (LIST + WATCH), publishing a ConfigMap, and
leader election with a coordination.k8s.io/v1 Lease.

Every request goes through kubernetes_asyncio (configuration, authentication, URLs, query parameters) but is made
with ``_preload_content=False`` and its JSON read here: the library's models are bypassed on purpose. That keeps the
watch in our hands (resourceVersion, bookmarks, 410), avoids a model round trip that would rewrite fields we do not
own, and lets us write Lease MicroTime values exactly (``2006-01-02T15:04:05.000000Z``), which the library's
``datetime.isoformat()`` serialization does not (``+00:00``, and no fraction at zero microseconds).

The parts: ``client`` (the API client, calls with deadlines, error mapping), ``nodes`` (the Node watch),
``configmap`` (publishing) and ``lease`` (election); their names are re-exported here.
"""


from __future__ import annotations

from raven.kube.client import MANAGED_BY, MAX_BACKOFF, KubeApiError, api_client
from raven.kube.configmap import ConfigMapPublisher, leader_sink
from raven.kube.lease import LeaseElector, format_microtime, parse_time
from raven.kube.nodes import KubeNode, NodeWatcher

__all__ = [
    "MANAGED_BY",
    "MAX_BACKOFF",
    "ConfigMapPublisher",
    "KubeApiError",
    "KubeNode",
    "LeaseElector",
    "NodeWatcher",
    "api_client",
    "format_microtime",
    "leader_sink",
    "parse_time",
]
