"""Which http(s) media URLs a server may fetch: a domain allow-list and an address filter.

Two independent checks, both applied to the first URL and again to every redirect:

    host check     vLLM's `--allowed-media-domains`: when a list is set, the URL's
                   hostname must equal one of its entries (exact match, no subdomains;
                   vLLM 0.33.0 compares `urllib3.parse_url(url).hostname`, which is
                   lowercased, against the list: vllm/multimodal/media/connector.py:370)
    address check  paged's addition: a server reachable from other machines must not be
                   turned into a proxy into its own network (SSRF). When on, every address
                   the hostname resolves to is classified, and loopback, private,
                   link-local, unique-local, multicast, reserved and cloud metadata
                   addresses are refused unless the hostname is in the allow-list.

The address check is on when the server listens on a non-loopback address
(`MediaUrlPolicy.for_bind_host`); a loopback-only server keeps vLLM's behaviour.
The check runs on the address actually connected to (see media_fetch.py), so a
name that resolves differently on a second lookup (DNS rebinding) gains nothing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from paged.multimodal.media_errors import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# aiohttp's default max_redirects, which vLLM's async media fetch uses (10).
DEFAULT_MAX_REDIRECTS = 10

# Instance metadata services hand out cloud credentials: named apart in the
# error so an operator reading the log sees what was attempted. Most are also
# link-local or unique-local, so the general rule refuses them too.
CLOUD_METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
        "169.254.170.2",  # AWS ECS task metadata
        "169.254.169.253",  # AWS DNS resolver
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd00:ec2::23",  # AWS IMDS IPv6 alternative
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud (classic)
    )
)
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")
# RFC 6052 well-known NAT64 prefix: the last 32 bits are an IPv4 address a
# NAT64 gateway connects to, so 64:ff9b::7f00:1 reaches 127.0.0.1.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class MediaUrlRefused(MediaError):
    """The server's media URL policy refuses this URL (the API answers 400)."""


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries to the IPv4 network, if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # (server, client): the client is where packets go
    return None


def classify_address(ip: IPAddress) -> str | None:
    """Why `ip` must not be fetched from by an exposed server; None for a public address.

    Public means `is_global` (IANA special-purpose registries) and not multicast;
    everything else is refused, which also covers shared address space
    (100.64.0.0/10), documentation and benchmarking ranges.
    """
    if ip in CLOUD_METADATA_ADDRESSES:
        return "a cloud metadata address"
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:  # the IPv4 address is where packets go: judge it alone
            reason = classify_address(inner)
            return None if reason is None else f"{reason} (embedded in the IPv6 address)"
        if ip in _UNIQUE_LOCAL:
            return "a unique-local address"
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_reserved:  # before is_private, which also covers 240.0.0.0/4
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a non-global address"
    return None


def is_loopback_host(host: str | None) -> bool:
    """Whether a server listening on `host` is reachable from this machine only.

    None and "" mean every interface (vLLM's default `--host`), as do 0.0.0.0
    and ::. A hostname counts as loopback only if every address it resolves to
    is; one that does not resolve is treated as exposed (the safe side).
    """
    if host is None or host.strip() == "":
        return False
    name = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    if name.lower().rstrip(".") == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    return bool(addresses) and all(a.is_loopback for a in addresses)


def normalize_host(host: str) -> str:
    """The form hostnames are compared and connected in: lowercase ASCII (IDNA for
    international names, as DNS sees them), no trailing dot, IPv6 without brackets."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if not name.isascii():
        # An invalid international name stays as given: it never matches nor resolves.
        with contextlib.suppress(UnicodeError):
            name = name.encode("idna").decode("ascii")
    return name


def parse_allowed_media_domains(domains: Iterable[str] | str | None) -> frozenset[str] | None:
    """vLLM's `--allowed-media-domains` (a list of hostnames) -> normalized set; None = any.

    An entry with a scheme, port, path or wildcard could never equal a URL's
    hostname, so it is refused here rather than silently refusing every URL.
    A comma-separated string is accepted too (for config files and `LLM(...)`).
    """
    if domains is None:
        return None
    items = domains.split(",") if isinstance(domains, str) else list(domains)
    allowed: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            raise ValueError(
                f"allowed_media_domains entries must be hostnames (strings), got {item!r}"
            )
        name = normalize_host(item)
        if not name:
            raise ValueError("allowed_media_domains has an empty entry")
        bad = next((c for c in "/:*@?# " if c in name), None)
        if bad is not None and not _is_ipv6(name):
            raise ValueError(
                f"allowed_media_domains entry {item!r} is not a bare hostname (it has "
                f"{bad!r}); give hosts like 'upload.wikimedia.org', without scheme, port or path"
            )
        allowed.add(name)
    if not allowed:
        raise ValueError("allowed_media_domains is empty; omit it to allow every domain")
    return frozenset(allowed)


def _is_ipv6(name: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address)
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class MediaUrlPolicy:
    """What http(s) media fetches a server allows; the default is vLLM's (anything).

    allowed_domains   None: any hostname; otherwise the only hostnames fetched from
                      (normalized; see `parse_allowed_media_domains`). A listed
                      hostname is also exempt from the address check.
    block_private     refuse hostnames resolving to non-public addresses.
    allow_redirects   vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS (default on).
    max_redirects     redirects followed before giving up.
    """

    allowed_domains: frozenset[str] | None = None
    block_private: bool = False
    allow_redirects: bool = True
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    def __post_init__(self) -> None:
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")

    @classmethod
    def for_bind_host(
        cls,
        bind_host: str | None,
        allowed_domains: Iterable[str] | str | None = None,
        *,
        allow_redirects: bool = True,
    ) -> MediaUrlPolicy:
        """The policy of a server listening on `bind_host`: addresses filtered unless loopback."""
        return cls(
            allowed_domains=parse_allowed_media_domains(allowed_domains),
            block_private=not is_loopback_host(bind_host),
            allow_redirects=allow_redirects,
        )

    def is_listed(self, host: str) -> bool:
        return self.allowed_domains is not None and normalize_host(host) in self.allowed_domains

    def check_host(self, host: str) -> None:
        """`MediaUrlRefused` unless the allow-list (if any) names `host`."""
        if self.allowed_domains is not None and not self.is_listed(host):
            raise MediaUrlRefused(
                f"The URL must be from one of the allowed domains: "
                f"{sorted(self.allowed_domains)}. Input URL domain: {normalize_host(host)}"
            )

    def check_address(self, host: str, ip: IPAddress) -> None:
        """`MediaUrlRefused` if an exposed server must not connect to `ip` for `host`."""
        if not self.block_private or self.is_listed(host):
            return
        reason = classify_address(ip)
        if reason is not None:
            raise MediaUrlRefused(
                f"media URL host {normalize_host(host)!r} resolves to {ip}, {reason}; this "
                "server listens on a non-loopback address and does not fetch from internal "
                "addresses (name the host in --allowed-media-domains to allow it)"
            )
