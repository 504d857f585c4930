"""Fetching an image URL, only as the MediaPolicy allows.

Off unless --allowed-media-domains names the URL's host. Then: http or https only, no user
info; the host is resolved once and every address it resolves to is checked (none may be
loopback, private, link-local, multicast or otherwise non-global unless
--allow-private-media-urls), and the connection goes to the checked address (the URL's host is
sent as Host and as the TLS server name, so certificates are still verified against it): a DNS
answer that changes between the check and the connect cannot redirect the fetch. Redirects are
followed by hand, at most `max_redirects`, each target checked as the first URL was. The body is
read up to `max_image_bytes` and the whole fetch is bounded by `fetch_timeout_s`. No proxy from
the environment is used (it would connect elsewhere than the checked address)."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from ..errors import invalid
from .policy import MediaPolicy


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # lower case, no brackets
    port: int
    path: str  # path and query

    def url_at(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
        literal = f"[{address}]" if address.version == 6 else str(address)
        return f"{self.scheme}://{literal}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def checked_target(url: str, policy: MediaPolicy, param: str) -> Target:
    """The URL's parts, or a 400: fetching off, a scheme other than http(s), credentials, or a host
    the policy does not name."""
    if not policy.fetches:
        raise invalid("image URLs are not fetched by this server (it was started without "
                      "--allowed-media-domains): send the image inline as a data URL", param)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise invalid(f"the image URL is not valid: {exc}", param) from None
    if parts.scheme not in ("http", "https"):
        raise invalid("image URLs must be http, https or data URLs", param)
    if parts.username is not None or parts.password is not None:
        raise invalid("image URLs may not carry credentials", param)
    host = (parts.hostname or "").lower().rstrip(".")
    if host not in policy.allowed_domains:
        raise invalid(f"fetching images from host {host!r} is not allowed (--allowed-media-domains)", param)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), path)


def address_allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address, policy: MediaPolicy) -> bool:
    if policy.allow_private_networks:
        return True
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return address.is_global and not address.is_multicast


async def checked_addresses(target: Target, policy: MediaPolicy, param: str) -> list:
    """The addresses the host resolves to, in order, once every one of them is checked."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise invalid(f"the image host {target.host!r} could not be resolved", param) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses or not all(address_allowed(a, policy) for a in addresses):
        raise invalid(f"the image host {target.host!r} resolves to a loopback, private or otherwise non-public "
                      "address, which this server does not fetch from", param)
    return list(dict.fromkeys(addresses))


async def fetch_image(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The body of an allowed image URL, or a 400 naming `param`."""
    try:
        return await asyncio.wait_for(_fetch(url, policy, param), policy.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise invalid(f"fetching the image took longer than {policy.fetch_timeout_s:g} s", param) from None


async def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    import httpx

    for _ in range(policy.max_redirects + 1):
        target = checked_target(url, policy, param)
        addresses = await checked_addresses(target, policy, param)
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False,
                                     timeout=policy.fetch_timeout_s) as client:
            response = await _connect(client, target, addresses, param)
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise invalid("the image URL redirected without a Location", param)
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise invalid(f"fetching the image answered HTTP {response.status_code}", param)
                return await _body(response, policy, param)
            except httpx.HTTPError as exc:
                raise invalid(f"fetching the image failed: {type(exc).__name__}", param) from None
            finally:
                await response.aclose()
    raise invalid(f"the image URL redirected more than {policy.max_redirects} times", param)


async def _connect(client, target: Target, addresses: list, param: str):
    """The response of the first checked address that accepts the connection."""
    import httpx

    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    failure = "ConnectError"
    for address in addresses:
        request = client.build_request("GET", target.url_at(address), headers={"Host": target.host_header},
                                       extensions=extensions)
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError:
            continue
        except httpx.HTTPError as exc:
            failure = type(exc).__name__
            break
    raise invalid(f"fetching the image failed: {failure}", param)


async def _body(response, policy: MediaPolicy, param: str) -> bytes:
    limit = policy.max_image_bytes
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise invalid(f"the image is {declared} bytes, more than the {limit} allowed", param)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise invalid(f"the image is more than the {limit} bytes allowed", param)
    return bytes(body)


__all__ = ["Target", "address_allowed", "checked_addresses", "checked_target", "fetch_image"]
