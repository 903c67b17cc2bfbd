"""Past one ConfigMap: the hosts file split into shards, each one CoreDNS ``hosts`` plugin reads.

A ConfigMap holds at most 1 MiB, and CoreDNS's ``hosts`` plugin may be used once per server block, reading one
file. Its ``view`` plugin (CoreDNS 1.10 and later) lets several server blocks serve the same zone, each chosen
by an expression on the query: so shard *k* (k >= 1) is a server block ``.`` whose view takes the names of that
shard, with its own ``hosts`` plugin reading ConfigMap ``edge-tunnel-nodes-<k>``; shard 0 stays in the main
server block (ConfigMap ``edge-tunnel-nodes``), which also answers everything else. ``deploy/coredns/`` shows
the Corefile (:func:`corefile_blocks` writes the view blocks for a number of shards).

The shard of a name is decided by its last character, which CoreDNS's expression language can test with a
regular expression (there is no hash function in it): a single-label name (no dot, what Kubernetes node names
usually are) whose last character is in shard *k*'s set belongs to shard *k*; names with a dot always stay in
shard 0, so that a view never takes a cluster-internal query (``x.svc.cluster.local.``) away from the main
block. Node names that end in digits (``edge-gpu-1234``) spread evenly over the digits' shards; each shard is
checked against the ConfigMap limit before it is written (see ``raven/kube``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from raven.dns.hosts import CONFIGMAP_MAX_BYTES, HEADER_ROOM, Address, check_names, render_checked, service_addresses

# A name's last character is one of these (RFC 1123: letters, digits; names are lower case here).
LAST_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"
MAX_SHARDS = 10  # the digits each get a shard at most; letters go round the same shards
# The capacity people are told (README.md, deploy/coredns/README.md, deploy/examples/gateway.yaml, hosts.shards's
# description; tests/unit/test_docs_agree.py holds them to it): names of this length ("edge-gpu-12345") with a
# Service's ClusterIPs of these lengths.
TYPICAL_NAME_LENGTH = 14
TYPICAL_ADDRESSES = ("10.96.123.45", "fd00:10:96::1234")


def shard_of(name: str, shards: int) -> int:
    """The shard that holds ``name`` (0 .. shards-1)."""
    if shards <= 1 or "." in name or not name:
        return 0
    index = LAST_CHARS.find(name[-1])
    return 0 if index < 0 else index % shards


def shard_chars(shard: int, shards: int) -> str:
    """The last characters of the single-label names in ``shard``."""
    return "".join(c for i, c in enumerate(LAST_CHARS) if i % shards == shard)


def view_regex(shard: int, shards: int) -> str:
    """The regular expression (RE2 and Python alike) on the query name, with its root dot, for ``shard`` >= 1."""
    return f"^[a-z0-9-]*[{shard_chars(shard, shards)}]\\.$"


def split(names: Iterable[str], shards: int) -> list[list[str]]:
    """``names`` by shard (see :func:`shard_of`), each in the order given."""
    out: list[list[str]] = [[] for _ in range(max(1, shards))]
    if shards <= 1:
        out[0].extend(names)
        return out
    by_last = {c: shard_of(c, shards) for c in LAST_CHARS}  # shard_of by last character: no call per name
    first = out[0]
    for name in names:
        if "." in name or not name:
            first.append(name)
        else:
            out[by_last.get(name[-1], 0)].append(name)
    return out


def render_shards(names: Iterable[str], addresses: Sequence[str], shards: int,
                  writer: str = "raven gateway", direct: Mapping[str, str] | None = None) -> list[str]:
    """One hosts file per shard (see :func:`raven.dns.hosts.render`); a direct pool's name (``direct``) goes
    to the shard its name selects, as a tunnel name would."""
    ordered = service_addresses(addresses)
    unique, bad = check_names(names)
    if bad:
        raise ValueError(f"{bad[0]!r} is not a valid RFC 1123 node name")
    return render_shards_checked(unique, ordered, shards, writer, direct)


def render_shards_checked(unique: Sequence[str], ordered: Sequence[Address], shards: int,
                          writer: str = "raven gateway", direct: Mapping[str, str] | None = None) -> list[str]:
    """:func:`render_shards` of names through :func:`~raven.dns.hosts.check_names` and addresses through
    :func:`~raven.dns.hosts.service_addresses` (each shard's part stays sorted and unique)."""
    own: list[dict[str, str]] = [{} for _ in range(max(1, shards))]
    for name, address in (direct or {}).items():
        own[shard_of(name, shards)][name] = address
    return [render_checked(part, ordered, writer, direct=own[k]) for k, part in enumerate(split(unique, shards))]


def line_bytes(name: str, addresses: Sequence[str]) -> int:
    """Bytes of ``name``'s lines in a hosts file: ``<address>\\t<name>\\n`` per service address."""
    return sum(len(a) + len(name) + 2 for a in addresses)


def ceiling(addresses: Sequence[str], name_length: int, limit: int = CONFIGMAP_MAX_BYTES) -> int:
    """How many names of ``name_length`` characters one ConfigMap holds with these service addresses."""
    per_name = line_bytes("x" * name_length, addresses)
    return (limit - HEADER_ROOM) // max(1, per_name)


def typical_capacity() -> tuple[int, int]:
    """Typical names one ConfigMap holds with one IPv4 service address, and with IPv4 and IPv6, in thousands as
    the docs say them ("about 37,000")."""
    v4 = ceiling(TYPICAL_ADDRESSES[:1], TYPICAL_NAME_LENGTH)
    dual = ceiling(TYPICAL_ADDRESSES, TYPICAL_NAME_LENGTH)
    return v4 // 1000 * 1000, dual // 1000 * 1000


def corefile_blocks(shards: int, path: str = "/etc/edge-shard-{k}/tunnel-nodes") -> str:
    """The CoreDNS server blocks for shards 1 .. shards-1 (shard 0 is the main block's ``hosts`` plugin)."""
    blocks = []
    for k in range(1, shards):
        blocks.append(
            f".:53 {{\n"
            f"    view raven-shard-{k} {{\n"
            f"        expr name() matches '{view_regex(k, shards)}'\n"
            f"    }}\n"
            f"    errors\n"
            f"    hosts {path.format(k=k)} {{\n"
            f"        ttl 30\n"
            f"        reload 10s\n"
            f"        fallthrough\n"
            f"    }}\n"
            f"    forward . /etc/resolv.conf\n"
            f"    cache 30\n"
            f"}}\n"
        )
    return "\n".join(blocks)
