"""The mDNS records of a tandem node: what it advertises (`Advert` → TXT keys) and what a
browser reads back (TXT keys and addresses → `Sighting`, a claim until `/v1/hello` proves it).

TXT keys: `id`, `name`, `roles` (comma-separated), `proto`, `model` (the fingerprint's first
`MODEL_PREFIX_HEX` hex digits), `device`, `mem` (bytes), and `cert` (the TLS certificate's
SHA-256, 64 hex) for a node that serves https.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from tandem.nodes.contract.cluster import Health, Peer
from tandem.nodes.contract.http import SERVICE_TYPE
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo

MODEL_PREFIX_HEX = 16  # TXT `model`: enough to tell models apart; trust checks the full one
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Advert:
    """What this node tells the LAN about itself: the TXT keys plus where it listens."""

    id: str
    name: str
    roles: tuple[str, ...]
    proto: int
    fingerprint: str
    device: str
    mem_bytes: int
    host: str
    port: int
    cert_fingerprint: str = ""  # "" when serving plain HTTP

    @classmethod
    def from_health(cls, health: Health, host: str, port: int) -> Advert:
        """The advert for a node whose `GET /health` says `health`."""
        return cls(
            id=health.id,
            name=health.name,
            roles=health.roles,
            proto=health.proto,
            fingerprint=health.fingerprint,
            device=health.device,
            mem_bytes=health.mem_bytes,
            host=host,
            port=port,
            cert_fingerprint=health.cert_fingerprint,
        )

    def properties(self) -> dict[str, str]:
        props = {
            "id": self.id,
            "name": self.name,
            "roles": ",".join(self.roles),
            "proto": str(self.proto),
            "model": self.fingerprint[:MODEL_PREFIX_HEX],
            "device": self.device,
            "mem": str(self.mem_bytes),
        }
        if self.cert_fingerprint:  # the whole fingerprint: 64 hex, well inside a TXT string
            props["cert"] = self.cert_fingerprint
        return props

    def instance_name(self) -> str:
        """`NAME-ID8._tandem._tcp.local.`: two nodes given one `--name` still differ."""
        suffix = f"-{self.id[:8]}"
        label = self.name.replace(".", "-").encode()[: 63 - len(suffix)]
        return f"{label.decode(errors='ignore')}{suffix}.{SERVICE_TYPE}"


@dataclass(frozen=True)
class Sighting:
    """One node as its mDNS records describe it: a claim, until `/v1/hello` proves it."""

    service: str
    id: str
    name: str
    roles: tuple[str, ...]
    proto: int
    model: str  # fingerprint prefix
    device: str
    mem_bytes: int
    port: int
    addresses: tuple[str, ...]  # best first
    cert_fingerprint: str = ""  # claimed; non-empty: it serves https://

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(url_for(a, self.port, bool(self.cert_fingerprint)) for a in self.addresses)

    def peer(self, url: str) -> Peer:
        return Peer(
            address=url,
            id=self.id,
            name=self.name,
            roles=self.roles,
            device=self.device,
            mem_bytes=self.mem_bytes,
            model={"name": "", "fingerprint": self.model},
            proto=self.proto,
            source="mdns",
            cert_fingerprint=self.cert_fingerprint,
        )


def url_for(host: str, port: int, tls: bool = False) -> str:
    """`http://host:port` (`https://` for a node serving TLS), an IPv6 literal in brackets."""
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def usable_address(ip: Address) -> bool:
    """Whether peers can use `ip` in a URL."""
    # link-local IPv6 needs a zone index, which URLs and aiohttp handle poorly
    return not (ip.is_unspecified or ip.is_multicast or (ip.version == 6 and ip.is_link_local))


def address_rank(ip: Address) -> int:
    """Loopback first (a node on this machine; its id is checked), then IPv4, then IPv6."""
    return 0 if ip.is_loopback else ip.version // 2  # 4 → 2, 6 → 3


def read_service(info: AsyncServiceInfo) -> Sighting | None:
    """A sighting from resolved records, or None when they are not a tandem node's."""
    props = info.decoded_properties
    node_id = props.get("id") or ""
    if not node_id or not info.port:
        return None
    ips = sorted(
        (ip for ip in info.ip_addresses_by_version(IPVersion.All) if usable_address(ip)),
        key=address_rank,
    )
    try:
        proto = int(props.get("proto") or 0)
        mem = int(props.get("mem") or 0)
    except ValueError:
        return None
    cert = (props.get("cert") or "").lower()
    if cert and not _FINGERPRINT.fullmatch(cert):
        return None
    return Sighting(
        service=info.name,
        id=node_id,
        name=props.get("name") or "",
        roles=tuple(r for r in (props.get("roles") or "").split(",") if r),
        proto=proto,
        model=props.get("model") or "",
        device=props.get("device") or "",
        mem_bytes=mem,
        port=info.port,
        addresses=tuple(str(ip) for ip in ips),
        cert_fingerprint=cert,
    )
