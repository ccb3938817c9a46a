"""MediaUrlPolicy: address classification, bind-host detection, --allowed-media-domains parsing."""

from __future__ import annotations

import ipaddress

import pytest

from paged.multimodal.media_url_policy import (
    MediaUrlPolicy,
    MediaUrlRefused,
    classify_address,
    is_loopback_host,
    parse_allowed_media_domains,
)


@pytest.mark.parametrize(
    "address,reason",
    [
        ("127.0.0.1", "a loopback address"),
        ("127.8.9.10", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("169.254.1.1", "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("fc00::1", "a unique-local address"),
        ("fd12:3456::1", "a unique-local address"),
        ("169.254.169.254", "a cloud metadata address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("100.100.100.200", "a cloud metadata address"),
        ("224.0.0.1", "a multicast address"),
        ("239.255.255.250", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("ff0e::1", "a multicast address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("240.0.0.1", "a reserved address"),
        ("100.64.0.1", "a non-global address"),  # shared address space (carrier NAT)
        ("192.0.2.7", "a private address"),  # documentation (TEST-NET-1)
        # IPv6 forms that deliver to an IPv4 address are judged by that address.
        ("::ffff:127.0.0.1", "a loopback address (embedded in the IPv6 address)"),
        ("::ffff:169.254.169.254", "a cloud metadata address (embedded in the IPv6 address)"),
        ("64:ff9b::a00:1", "a private address (embedded in the IPv6 address)"),
        ("2002:7f00:1::", "a loopback address (embedded in the IPv6 address)"),
    ],
)
def test_internal_addresses_are_classified(address: str, reason: str) -> None:
    assert classify_address(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert classify_address(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        (None, False),  # vLLM's default --host: every interface
        ("", False),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("8.8.8.8", False),
        ("no-such-host.invalid", False),  # unresolvable: treated as exposed
    ],
)
def test_bind_host_loopback_detection(host: str | None, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
    assert MediaUrlPolicy.for_bind_host(host).block_private is not loopback


def test_allowed_media_domains_parsing() -> None:
    assert parse_allowed_media_domains(None) is None
    assert parse_allowed_media_domains(["Upload.Wikimedia.org", "example.com."]) == frozenset(
        {"upload.wikimedia.org", "example.com"}
    )
    assert parse_allowed_media_domains("a.com, b.com") == frozenset({"a.com", "b.com"})
    assert parse_allowed_media_domains(["[::1]", "10.0.0.5"]) == frozenset({"::1", "10.0.0.5"})
    # International names are compared as DNS sees them (IDNA), whichever form is given.
    assert parse_allowed_media_domains(["Bücher.example"]) == frozenset({"xn--bcher-kva.example"})


@pytest.mark.parametrize(
    "domains,match",
    [
        (["https://example.com"], "not a bare hostname"),
        (["example.com:8080"], "not a bare hostname"),
        (["example.com/images"], "not a bare hostname"),
        (["*.example.com"], "not a bare hostname"),
        (["ok.com", " "], "empty entry"),
        ([], "is empty"),
        ([3], "must be hostnames"),
    ],
)
def test_bad_allowed_media_domains_are_refused(domains: list[object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_allowed_media_domains(domains)  # type: ignore[arg-type]


def test_check_host_is_an_exact_case_insensitive_match() -> None:
    policy = MediaUrlPolicy(parse_allowed_media_domains(["example.com"]))
    policy.check_host("example.com")
    policy.check_host("EXAMPLE.com")
    for host in ("cdn.example.com", "example.com.evil.net", "evil.net"):
        with pytest.raises(MediaUrlRefused, match=f"Input URL domain: {host}$"):
            policy.check_host(host)
    MediaUrlPolicy().check_host("anything.example")  # no list: any host
    MediaUrlPolicy(parse_allowed_media_domains(["xn--bcher-kva.example"])).check_host(
        "bücher.example"
    )


def test_check_address_depends_on_binding_and_listing() -> None:
    loopback = ipaddress.ip_address("127.0.0.1")
    metadata = ipaddress.ip_address("169.254.169.254")
    MediaUrlPolicy(block_private=False).check_address("h", loopback)  # vLLM behaviour
    exposed = MediaUrlPolicy(block_private=True)
    with pytest.raises(MediaUrlRefused, match=r"'h' resolves to 127\.0\.0\.1, a loopback"):
        exposed.check_address("h", loopback)
    with pytest.raises(MediaUrlRefused, match="cloud metadata"):
        exposed.check_address("h", metadata)
    exposed.check_address("h", ipaddress.ip_address("8.8.8.8"))
    listed = MediaUrlPolicy(parse_allowed_media_domains(["intranet"]), block_private=True)
    listed.check_address("intranet", loopback)  # named by the operator: allowed
    with pytest.raises(MediaUrlRefused):
        listed.check_address("other", loopback)
    with pytest.raises(ValueError, match="max_redirects"):
        MediaUrlPolicy(max_redirects=-1)
