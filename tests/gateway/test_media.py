"""gateway/media without a server: what a URL fetch may reach, data URLs, image checks, the flags."""
from __future__ import annotations

import argparse
import asyncio
import base64
import ipaddress

import pytest

from switchyard.core.testing.tiny_vlm import png_bytes
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.media import ImageRef, MediaPolicy, load_images
from switchyard.gateway.media.data_url import data_url_bytes
from switchyard.gateway.media.decode import read_image
from switchyard.gateway.media.fetch import Target, address_allowed, checked_addresses, checked_target
from switchyard.gateway.media.flags import add_media_flags, media_policy

ALLOWED = MediaPolicy(allowed_domains=("images.example.com", "127.0.0.1"))


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
])
def test_only_global_addresses_are_fetched_unless_private_ones_are_allowed(address, public):
    ip = ipaddress.ip_address(address)
    assert address_allowed(ip, MediaPolicy()) is public
    assert address_allowed(ip, MediaPolicy(allow_private_networks=True))


@pytest.mark.parametrize("url, words", [
    ("https://elsewhere.example.com/a.png", "not allowed"),
    ("ftp://images.example.com/a.png", "http, https or data"),
    ("https://user:pw@images.example.com/a.png", "credentials"),
    ("file:///etc/passwd", "http, https or data"),
    ("https://images.example.com.evil.com/a.png", "not allowed"),
])
def test_urls_outside_the_policy_are_refused_before_any_connection(url, words):
    with pytest.raises(GatewayError, match=words) as caught:
        checked_target(url, ALLOWED, "messages.0.content.1")
    assert caught.value.param == "messages.0.content.1"


def test_fetching_is_off_without_allowed_domains():
    with pytest.raises(GatewayError, match="--allowed-media-domains"):
        checked_target("https://images.example.com/a.png", MediaPolicy(), "p")


def test_a_target_connects_to_the_checked_address_and_keeps_its_host():
    target = checked_target("https://images.example.com:8443/a/b.png?x=1", ALLOWED, "p")
    assert target == Target("https", "images.example.com", 8443, "/a/b.png?x=1")
    assert target.url_at(ipaddress.ip_address("93.184.216.34")) == "https://93.184.216.34:8443/a/b.png?x=1"
    assert target.url_at(ipaddress.ip_address("2606:4700::1111")) == "https://[2606:4700::1111]:8443/a/b.png?x=1"
    assert target.host_header == "images.example.com:8443"


def test_a_loopback_host_is_refused_after_resolution():
    target = checked_target("http://127.0.0.1:9/a.png", ALLOWED, "p")
    with pytest.raises(GatewayError, match="loopback"):
        asyncio.run(checked_addresses(target, ALLOWED, "p"))
    allowed = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_networks=True)
    assert [str(a) for a in asyncio.run(checked_addresses(target, allowed, "p"))] == ["127.0.0.1"]


def test_data_urls():
    png = png_bytes(4, 4)
    assert data_url_bytes("data:image/png;base64," + base64.b64encode(png).decode(), "p") == png
    for url, words in (("data:image/png,abc", "must be base64"), ("data:text/html;base64,AAAA", "not an image"),
                       ("data:image/png;base64", "no ','"), ("data:image/png;base64,###", "not valid base64")):
        with pytest.raises(GatewayError, match=words):
            data_url_bytes(url, "p")


def test_image_checks_read_the_header_before_decoding():
    policy = MediaPolicy(max_image_pixels=100, max_image_bytes=1 << 20)
    image = read_image(png_bytes(10, 10), policy, "p")
    assert (image.width, image.height, image.format) == (10, 10, "PNG") and len(image.content_hash) == 64
    with pytest.raises(GatewayError, match="11x10 pixels"):
        read_image(png_bytes(11, 10), policy, "p")
    with pytest.raises(GatewayError, match="bytes"):
        read_image(png_bytes(10, 10), MediaPolicy(max_image_bytes=10), "p")
    with pytest.raises(GatewayError, match="format TIFF"):
        read_image(png_bytes(10, 10, fmt="TIFF"), policy, "p")
    with pytest.raises(GatewayError, match="could not be read"):
        read_image(png_bytes(10, 10)[:60], policy, "p")


def test_the_image_limit_names_the_first_image_past_it():
    refs = [ImageRef(f"messages.0.content.{i}", url="data:image/png;base64,AAAA") for i in range(3)]
    with pytest.raises(GatewayError) as caught:
        asyncio.run(load_images(refs, MediaPolicy(limit_per_prompt=2)))
    assert caught.value.param == "messages.0.content.2"


def test_flags():
    parser = argparse.ArgumentParser()
    add_media_flags(parser, {})
    policy = media_policy(parser.parse_args(["--allowed-media-domains", "Images.Example.com.", "--limit-mm-per-prompt",
                                             '{"image": 3}', "--allow-private-media-urls"]))
    assert policy == MediaPolicy(allowed_domains=("images.example.com",), allow_private_networks=True,
                                 limit_per_prompt=3)
    assert media_policy(parser.parse_args([])) == MediaPolicy()
    assert media_policy(parser.parse_args(["--limit-mm-per-prompt", "5"])).limit_per_prompt == 5
