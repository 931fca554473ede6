"""Which addresses a webhook may be sent to, checked at send time; and the connection
goes to the address that was checked.

Allowed without an allowlist entry: public addresses on port 80 or 443. `is_global`
alone is not enough: it is true for multicast, for the NAT64 prefixes and for 6to4,
through which a public-looking IPv6 address reaches an IPv4 one. So:

- multicast, Teredo (2001::/32), 6to4 (2002::/16) and local-use NAT64 (64:ff9b:1::/48,
  whose prefix length, and so its embedded IPv4, cannot be known) are refused;
- a well-known-prefix NAT64 address (64:ff9b::/96) and an IPv4-mapped one count as
  the IPv4 address they embed (DNS64 networks hand out the former for every IPv4-only
  receiver, so refusing them would refuse every such receiver there);
- everything else must be global and neither reserved, loopback, link- nor site-local.

The allowlist (BinderSettings' docstring has the syntax) lets chosen hosts, addresses
and ports through."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_PORTS = frozenset({80, 443})
NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")
SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
TEREDO = ipaddress.IPv6Network("2001::/32")


class Refused(Exception):
    """We will not send to this URL (its host, address or port); retrying cannot help."""


class Unresolvable(Exception):
    """The host name did not resolve now; a later attempt may succeed."""


@dataclass(frozen=True)
class Target:
    """A checked destination: the host in ASCII (IDNA), the port, the address to use."""

    host: str
    port: int
    address: str


@dataclass(frozen=True)
class AllowEntry:
    host: str | None = None  # a host name, matched whatever it resolves to
    network: IPNetwork | None = None
    port: int | None = None  # None: any port

    def matches(self, host: str, address: IPAddress, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.host is not None:
            return host == self.host
        return self.network is not None and address in self.network


def ascii_host(host: str) -> str:
    """The host as sent on the wire: an IP literal as is, a name IDNA-encoded.
    Raises Refused for a name that cannot be one (an empty or 64+ character label,
    253+ characters, characters IDNA refuses)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        encoded = host.rstrip(".").encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise Refused(f"invalid host name ({exc})") from None
    if not encoded or len(encoded) > 253:
        raise Refused("invalid host name (empty or longer than 253 characters)")
    return encoded


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"allowlist entry {entry!r}: {text!r} is not a port")
    return int(text)


def parse_allow_entry(entry: str) -> AllowEntry:
    """`host`, `IP`, `CIDR`, any of them with `:port` (IPv6 in brackets), or `*:port`."""
    text = entry.strip()
    if text.startswith("*:"):
        return AllowEntry(port=_port(text[2:], entry))
    port: int | None = None
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"allowlist entry {entry!r}: expected [IPv6] or [IPv6]:port")
        text, port = inside, _port(rest[1:], entry) if rest else None
    else:
        try:
            return AllowEntry(network=ipaddress.ip_network(text, strict=False))
        except ValueError:
            pass
        if ":" in text:
            text, _, port_text = text.rpartition(":")
            port = _port(port_text, entry)
    try:
        return AllowEntry(network=ipaddress.ip_network(text, strict=False), port=port)
    except ValueError:
        pass
    if not text or "/" in text or "[" in text or "]" in text:
        raise ValueError(f"allowlist entry {entry!r} is not a host, an address or a network")
    try:
        return AllowEntry(host=ascii_host(text), port=port)
    except Refused as exc:
        raise ValueError(f"allowlist entry {entry!r}: {exc}") from None


def address_refusal(address: IPAddress) -> str | None:
    """Why we will not connect to this address when it is not allow-listed, or None."""
    if address.is_multicast:
        return "a multicast address"
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is not None:
            inner = address_refusal(mapped)
            return f"an IPv4-mapped address of {mapped}, {inner}" if inner else None
        if address in NAT64_WELL_KNOWN:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
            inner = address_refusal(embedded)
            return f"a NAT64 address of {embedded}, {inner}" if inner else None
        if address in NAT64_LOCAL_USE:
            return "a local-use NAT64 address (64:ff9b:1::/48)"
        if address in SIX_TO_FOUR:
            return "a 6to4 address (2002::/16)"
        if address in TEREDO:
            return "a Teredo address (2001::/32)"
        if address.is_site_local:
            return "not a public address"
    if (
        not address.is_global
        or address.is_reserved
        or address.is_unspecified
        or address.is_loopback
        or address.is_link_local
    ):
        return "not a public address"
    return None


class AddressGuard:
    """Decides, at send time, whether a URL's host and port may be contacted."""

    def __init__(self, allowlist: list[str]) -> None:
        parsed = [parse_allow_entry(entry) for entry in allowlist]
        self.entries = [e for e in parsed if e.host is not None or e.network is not None]
        self.public_ports = DEFAULT_PORTS | {e.port for e in parsed if e.port is not None and e not in self.entries}

    async def resolve(self, url: str) -> Target:
        """The checked destination. Raises Refused (for good) or Unresolvable (for now)."""
        parts = urlsplit(url)
        try:
            explicit_port = parts.port
        except ValueError as exc:
            raise Refused(f"invalid port ({exc})") from None
        port = explicit_port or (443 if parts.scheme == "https" else 80)
        host = ascii_host(parts.hostname or "")
        try:
            addresses: list[IPAddress] = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = await self._lookup(host, port)
        for address in addresses:
            refusal = self.refusal(host, address, port)
            if refusal:
                raise Refused(refusal)
        return Target(host, port, str(addresses[0]))

    @staticmethod
    async def _lookup(host: str, port: int) -> list[IPAddress]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as exc:
            raise Unresolvable(f"cannot resolve {host}: {exc}") from None
        # A scoped IPv6 answer ("fe80::1%eth0") loses its scope: it is link-local anyway.
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
        if not addresses:
            raise Unresolvable(f"{host} has no address")
        return addresses

    def refusal(self, host: str, address: IPAddress, port: int) -> str | None:
        """Why (host, address, port) may not be contacted, or None when it may."""
        if any(entry.matches(host, address, port) for entry in self.entries):
            return None
        why = address_refusal(address)
        if why and host == str(address):
            return f"{host} is {why}"
        if why:
            # The refusal is recorded where the tenant reads it: never what an internal name
            # resolves to (the address, or one embedded in it), nor what kind of address it is.
            return f"{host} resolves to an address that is refused (not a public address, and not allow-listed)"
        if port not in self.public_ports:
            allowed = ", ".join(str(p) for p in sorted(self.public_ports))
            return f"port {port} is not allowed (only {allowed} unless allow-listed)"
        return None


def pinned(url: str, target: Target) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL with its host replaced by the checked address, the Host header and TLS
    name to keep (so DNS cannot switch the address between check and connect)."""
    parts = urlsplit(url)
    address = f"[{target.address}]" if ":" in target.address else target.address
    named = f"[{target.host}]" if ":" in target.host else target.host
    explicit = parts.port is not None
    netloc = f"{address}:{target.port}" if explicit else address
    host_header = f"{named}:{target.port}" if explicit else named
    extensions = {"sni_hostname": target.host} if parts.scheme == "https" and not _is_ip(target.host) else {}
    return urlunsplit(parts._replace(netloc=netloc)), {"Host": host_header}, extensions


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
