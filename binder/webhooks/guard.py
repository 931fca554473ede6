"""Which addresses a webhook may be sent to: public ones only, unless allow-listed,
checked at send time; and the connection goes to the address that was checked."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit, urlunsplit


class Refused(Exception):
    """The URL resolves to an address we will not send to."""


class AddressGuard:
    """Decides, at send time, whether a URL's host may be contacted."""

    def __init__(self, allowlist: list[str]) -> None:
        self.hosts = set()
        self.networks = []
        for entry in allowlist:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.hosts.add(entry.lower())

    async def resolve(self, url: str) -> str:
        """The address to connect to, or Refused."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Refused(f"cannot resolve {host}: {exc}") from None
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        if not addresses:
            raise Refused(f"{host} has no address")
        for address in addresses:
            if not self._allowed(host, address):
                raise Refused(f"{host} resolves to {address}, which is not a public address")
        return str(addresses[0])

    def _allowed(self, host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if host.lower() in self.hosts or any(address in net for net in self.networks):
            return True
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_global


def pinned(url: str, address: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL with its host replaced by the checked address, the Host header and TLS
    name to keep (so DNS cannot switch the address between check and connect)."""
    parts = urlsplit(url)
    host_ip = f"[{address}]" if ":" in address else address
    netloc = f"{host_ip}:{parts.port}" if parts.port else host_ip
    host_header = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return urlunsplit(parts._replace(netloc=netloc)), {"Host": host_header}, extensions
