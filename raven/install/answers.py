"""The answers ``raven install`` renders an installation from: a short YAML file and/or flags, checked here.

    service_address: 10.96.0.100          # a free address in the service CIDR: the front Service's ClusterIP
    image: registry.example.com/raven/raven-tunnel:0.2.0
    certificates: cert-manager            # or raven: Raven's own CA, certificates issued into secrets_dir
    monitoring: operator                  # or prometheus (a ConfigMap with the scrape jobs and rules), or none
    layer3: false                         # true: gateways with layer 3 (needed by layer3 pools)
    cloud_cidrs: [10.244.0.0/16, 10.96.0.0/12]   # layer 3: the cloud's ranges the pools may reach
    pool_label: apps.openyurt.io/nodepool
    pools:
      - name: pool-a                      # reach: tunnel (default); agents on the nodes labelled pool_label=pool-a
      - name: pool-b
        node_selector: {apps.openyurt.io/nodepool: pool-b, raven.io/agent: "true"}
      - name: dc-1
        reach: direct                     # Prometheus scrapes it itself: no agents
      - name: pool-c
        reach: layer3
        cidrs: [10.20.0.0/16]
        lan_address: 192.0.2.100/24       # the pool's floating address its other nodes route through

Every problem is one line naming the field (a :class:`~raven.errors.ConfigError`), never a traceback.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from raven.config.loading import load_tree
from raven.config.pools import Reach
from raven.errors import ConfigError
from raven.model import Model
from raven.names import PoolName

MAX_POOLS = 1000
DEFAULT_IMAGE = "raven-tunnel:0.1.0"


class PoolAnswer(Model):
    name: PoolName
    reach: Reach = "tunnel"
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=16,
        description="labels of the nodes the pool's agents run on; default: {pool_label: name}",
    )
    cidrs: list[str] = Field(default_factory=list, max_length=64, description="layer 3: the pool's ranges")
    lan_address: str | None = Field(None, description="layer 3: the pool's floating address (CIDR notation)")

    @field_validator("cidrs")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as exc:
                raise ValueError(f"{cidr!r} is not a network: {exc}") from None
        return value

    @field_validator("lan_address")
    @classmethod
    def _interface(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.ip_interface(value)
            except ValueError:
                raise ValueError(f"{value!r} is not an address with a prefix length (e.g. 192.0.2.100/24)") from None
        return value

    @model_validator(mode="after")
    def _layer3_fields(self) -> PoolAnswer:
        if self.reach == "layer3" and not (self.cidrs and self.lan_address):
            raise ValueError(f"pool {self.name}: a layer3 pool needs cidrs and lan_address")
        if self.reach != "layer3" and (self.cidrs or self.lan_address):
            raise ValueError(f"pool {self.name}: cidrs and lan_address are for layer3 pools only")
        return self

    def selector(self, pool_label: str) -> dict[str, str]:
        return dict(self.node_selector) or {pool_label: self.name}


class Answers(Model):
    service_address: str
    image: str = DEFAULT_IMAGE
    certificates: Literal["cert-manager", "raven"] = "cert-manager"
    monitoring: Literal["operator", "prometheus", "none"] = "operator"
    layer3: bool = False
    cloud_cidrs: list[str] = Field(default_factory=lambda: ["10.244.0.0/16", "10.96.0.0/12"], max_length=64)
    pool_label: str = Field("apps.openyurt.io/nodepool", min_length=1, max_length=317)
    pools: list[PoolAnswer] = Field(min_length=1, max_length=MAX_POOLS)

    @field_validator("service_address")
    @classmethod
    def _address(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (a free ClusterIP in the service CIDR)") from None

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value) or value.startswith(("-", ":", "@")):
            raise ValueError(f"{value!r} is not an image reference (REPOSITORY[:TAG][@sha256:DIGEST])")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Answers:
        names = [p.name for p in self.pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pools: {', '.join(dup)} listed twice")
        layer3 = [p.name for p in self.pools if p.reach == "layer3"]
        if layer3 and not self.layer3:
            raise ValueError(f"pools {', '.join(layer3)} are reached by layer 3: set layer3: true (--layer3)")
        return self

    def image_parts(self) -> tuple[str, str | None, str | None]:
        """(repository, tag, digest) as kustomize's ``images`` wants them."""
        ref, _, digest = self.image.partition("@")
        slash = ref.rfind("/")
        colon = ref.rfind(":")
        if colon > slash:
            return ref[:colon], ref[colon + 1:], digest or None
        return ref, None, digest or None


def parse_pool_flag(text: str) -> dict[str, object]:
    """``--pool NAME[=REACH]``."""
    name, _, reach = text.partition("=")
    out: dict[str, object] = {"name": name}
    if reach:
        out["reach"] = reach
    return out


def load(path: Path | None, flags: dict[str, object]) -> Answers:
    """The answers file (if any) with the flags that were given on top; ConfigError names every problem."""
    tree: dict[str, object] = dict(load_tree(path))  # the configuration's own reader: same errors, same words
    tree.update({k: v for k, v in flags.items() if v is not None and v != []})
    try:
        return Answers.model_validate(tree)
    except ValidationError as exc:
        where = f"{path}: " if path is not None else ""
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(answers)"
            problems.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
        raise ConfigError(where + "; ".join(problems)) from None
