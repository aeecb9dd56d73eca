"""The egress proxy of `reploy serve` ("the egress proxy"): its pure core (the allow-list's
entries, the proxy request parser, the decision on resolved addresses), then its host side on
real sockets without Docker: a unix socket like a session's DIR/agent/egress.sock, and
listeners of the test's own on 127.0.0.1."""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import json
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402
import reploy_serve as rs  # noqa: E402


def head(*lines: str) -> bytes:
    return "\r\n".join(lines).encode()


# -- entries: --egress-allow and a create's egress ---------------------------------------------


@pytest.mark.parametrize(("text", "entry"), [
    ("api.example.com", ("api.example.com", 443)),
    ("API.Example.COM:8443", ("api.example.com", 8443)),
    ("localhost:80", ("localhost", 80)),
    ("a-b.c9:1", ("a-b.c9", 1)),
    ("10.0.0.1:65535", ("10.0.0.1", 65535)),
    ("[::1]:8080", ("::1", 8080)),
    ("[2001:DB8:0:0::1]", ("2001:db8::1", 443)),
])
def test_an_entry_is_a_dns_name_or_an_ip_literal_with_port_443_by_default(
        text: str, entry: tuple[str, int]) -> None:
    parsed = rs.parse_egress_entry(text)
    assert (parsed.host, parsed.port) == entry
    assert rs.parse_egress_entry(str(parsed)) == parsed  # what is stored parses back


@pytest.mark.parametrize("text", [
    "", ":443", "example.com:", "example.com:0", "example.com:65536", "example.com:-1",
    "example.com:４４３", "example.com:1e3", "http://example.com", "example.com/path",
    "user@example.com", "exa mple.com", "-example.com", "example-.com", "example..com",
    "example.com.", "a" * 64 + ".com", ".".join(["a" * 63] * 4) + ".com", "127.1",
    "0x7f.1", "1.2.3.4.5", "exämple.com", "[::1", "[::1]x", "[example.com]:443", "[10.0.0.1]:443",
    "::1", "::1:443:x", "fe80::1%eth0", "[fe80::1%eth0]:443", "example.com:443:1",
])
def test_anything_else_is_refused_with_a_reason(text: str) -> None:
    with pytest.raises(ValueError) as refused:
        rs.parse_egress_entry(text)
    assert str(refused.value)


def test_the_server_list_is_a_usage_error_when_bad_and_repeats_are_one_entry() -> None:
    entries = rs.parse_egress_allow(["a.example", "A.example:443", "b.example:80"])
    assert list(map(str, entries)) == ["a.example:443", "b.example:80"]
    with pytest.raises(rs.UsageError, match="--egress-allow"):
        rs.parse_egress_allow(["not a host"])
    with pytest.raises(rs.UsageError, match="at most"):
        rs.parse_egress_allow([f"h{i}.example" for i in range(rs.MAX_EGRESS_ENTRIES + 1)])


@pytest.mark.parametrize("entry", ["not a host", "example.com:0", "http://example.com", "::1"])
def test_a_bad_egress_allow_is_a_usage_error_of_serve(entry: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "serve", "--state-dir", str(tmp_path),
                           "--workload-dir", str(tmp_path), "--egress-allow", entry],
                          capture_output=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == b"" and b"--egress-allow" in proc.stderr, proc.stderr
    assert not (tmp_path / "token").exists()


def test_a_create_lists_only_entries_of_the_server_each_once() -> None:
    allowed = rs.parse_egress_allow(["a.example", "127.0.0.1:8080"])
    assert rs.session_egress(["A.example:443", "127.0.0.1:8080"], allowed) == (
        "a.example:443", "127.0.0.1:8080")
    assert rs.session_egress([], allowed) == ()
    for asked, reason in ((["b.example"], "not on this server's --egress-allow list"),
                          (["a.example:80"], "not on this server's"),
                          (["a.example", "a.example:443"], "given twice"),
                          (["a.example/x"], "not a DNS name")):
        with pytest.raises(rs.BadRequest, match=reason):
            rs.session_egress(asked, allowed)
    with pytest.raises(rs.BadRequest, match="it has none"):
        rs.session_egress(["a.example"], ())


def test_the_create_body_takes_egress_as_an_array_of_strings() -> None:
    rules = rs.BODY_RULES["create"]
    fields = rs.parse_body(b'{"name": "n", "egress": ["a.example"]}', rules)
    assert rs.CreateRequest.from_fields(fields).egress == ("a.example",)
    assert rs.CreateRequest.from_fields(rs.parse_body(b'{"name": "n"}', rules)).egress == ()
    with pytest.raises(rs.BadRequest, match="must be an array"):
        rs.parse_body(b'{"name": "n", "egress": "a.example"}', rules)
    with pytest.raises(rs.BadRequest, match="must be a string"):
        rs.CreateRequest.from_fields(rs.parse_body(b'{"name": "n", "egress": [1]}', rules))


def test_a_stored_spec_keeps_its_egress_and_an_older_one_has_none() -> None:
    runtime = rs.Runtime(uid=1000, gid=1000, writable_paths=("/tmp",), memory_mib=256, pids=64)
    spec = rs.SessionSpec("shell", None, "d", "id", "img", 1, runtime, egress=("a.example:443",))
    assert rs.SessionSpec.from_json(spec.to_json()) == spec
    older = spec.to_json().replace(', "egress": ["a.example:443"]', "")
    assert "egress" not in older and rs.SessionSpec.from_json(older).egress == ()


def test_the_agent_takes_an_egress_note_strictly() -> None:
    """serve records each decision through the agent's egress_note (the outbox's one writer)."""
    def parse(params: dict[str, object]) -> agent.Request:
        return agent.parse_request(json.dumps({"id": "1", "method": "egress_note", "params": params}).encode())
    request = parse({"decision": "refused", "host": "api.example", "port": 443, "reason": "why"})
    assert request.params == agent.EgressNoteParams(agent.EgressDecision.REFUSED, "api.example", 443,
                                                    "why", 0, 0, None)
    assert parse({"decision": "allowed"}).params == agent.EgressNoteParams(
        agent.EgressDecision.ALLOWED, None, 0, None, 0, 0, None)
    assert parse({"decision": "refused", "count": 7}).params.count == 7
    for bad in ({}, {"decision": "maybe"}, {"decision": "allowed", "port": 65536},
                {"decision": "allowed", "host": ""}, {"decision": "allowed", "bytes_up": -1},
                {"decision": "allowed", "extra": 1}, {"decision": "refused", "count": 0}):
        with pytest.raises(agent.RequestError):
            parse(bad)


# -- the decision ----------------------------------------------------------------------------

REFUSED_ADDRESSES = {
    "127.0.0.1": "loopback", "127.255.0.9": "loopback", "::1": "loopback",
    "0.0.0.0": "unspecified", "::": "unspecified",
    "169.254.169.254": "metadata", "fd00:ec2::254": "metadata",
    "169.254.1.1": "link-local", "fe80::1": "link-local",
    "10.1.2.3": "private", "172.16.0.1": "private", "172.31.255.255": "private",
    "192.168.1.1": "private", "fd12::1": "private (ULA)", "fc00::1": "private (ULA)",
    "100.64.0.1": "CGNAT", "100.127.255.254": "CGNAT",
    "224.0.0.1": "multicast", "239.1.1.1": "multicast", "ff02::1": "multicast",
    "240.0.0.1": "reserved", "255.255.255.255": "reserved", "192.0.0.8": "IETF protocol assignments",
    "198.18.0.1": "benchmarking", "fec0::1": "site-local",
    "::ffff:127.0.0.1": "loopback", "::ffff:10.0.0.1": "private", "::127.0.0.1": "loopback",
    "2002:a00:1::": "private",  # 6to4 of 10.0.0.1
    "64:ff9b::a9fe:a9fe": "metadata",  # NAT64 of 169.254.169.254
    # Issue 42: the documentation ranges, and more IPv6 forms of a refused IPv4 address.
    "192.0.2.1": "documentation", "198.51.100.7": "documentation", "203.0.113.255": "documentation",
    "2001:db8::1": "documentation", "3fff::1": "documentation",
    "::ffff:0:10.0.0.1": "private",  # IPv4-translated (SIIT) of 10.0.0.1
    "::ffff:0:7f00:1": "loopback",  # the same form of 127.0.0.1
    "2001:0:4136:e378:8000:63bf:f5ff:fffe": "private",  # Teredo, its client 10.0.0.1 (obfuscated)
    "2001:0:a9fe:a9fe::1": "metadata",  # Teredo, its server 169.254.169.254
    "2002:c000:201::1": "documentation",  # 6to4 of 192.0.2.1
    "64:ff9b::c633:6401": "documentation",  # NAT64 of 198.51.100.1
    "64:ff9b:1::5db8:d822": "NAT64 (local use)", "2001:2::1": "benchmarking", "100::1": "discard-only",
}
PUBLIC_ADDRESSES = ("93.184.216.34", "172.32.0.1", "100.128.0.1", "192.169.0.1", "1.1.1.1",
                    "2606:4700::1111", "::ffff:93.184.216.34", "169.253.255.255")


@pytest.mark.parametrize(("address", "what"), sorted(REFUSED_ADDRESSES.items()))
def test_every_refused_range_is_refused_for_a_name_and_named(address: str, what: str) -> None:
    assert rs.refused_range(address) == what
    allowed = rs.parse_egress_allow(["api.example"])
    decision = rs.decide_egress(allowed, "api.example", 443, ["93.184.216.34", address])
    assert decision == rs.Refused(f"api.example resolves to {address}, a {what} address; list "
                                  "that address itself to allow it")


#: Addresses the test pretends are this host's own (one public, one of each family).
OWN = frozenset({"93.184.216.34", "2606:4700::1111"})


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700::1111", "::ffff:93.184.216.34",
                                     "::ffff:0:93.184.216.34", "64:ff9b::5db8:d822", "2002:5db8:d822::1"])
def test_an_address_of_the_host_itself_is_refused_for_a_name_in_every_form(address: str) -> None:
    """Issue 42: a listed name that resolves to one of the host's own interface addresses
    reaches the host's services, whatever their bind: refused, as loopback is."""
    allowed = rs.parse_egress_allow(["api.example"])
    assert rs.refused_range(address, OWN) == "serve host's"
    assert rs.decide_egress(allowed, "api.example", 443, ["1.1.1.1", address], OWN) == rs.Refused(
        f"api.example resolves to {address}, a serve host's address; list that address itself to allow it")
    literal = rs.parse_egress_entry(f"[{address}]:443" if ":" in address else address)
    assert rs.decide_egress((literal,), literal.host, 443, (), OWN) == rs.Allowed((literal.host,))


def test_the_hosts_own_addresses_are_its_interfaces_now() -> None:
    own = rs.host_addresses()
    assert "127.0.0.1" in own
    assert all(str(ipaddress.ip_address(address)) == address for address in own)


@pytest.mark.parametrize("address", PUBLIC_ADDRESSES)
def test_a_public_address_of_a_listed_name_is_allowed(address: str) -> None:
    assert rs.refused_range(address) is None
    allowed = rs.parse_egress_allow(["api.example:8443"])
    assert rs.decide_egress(allowed, "api.example", 8443, [address, "1.0.0.1"]) == rs.Allowed(
        (address, "1.0.0.1"))


@pytest.mark.parametrize("address", sorted(REFUSED_ADDRESSES))
def test_an_ip_literal_entry_allows_exactly_that_address_whatever_its_range(address: str) -> None:
    entry = rs.parse_egress_entry(f"[{address}]:8080" if ":" in address else f"{address}:8080")
    assert rs.decide_egress((entry,), entry.host, 8080, ()) == rs.Allowed((entry.host,))
    assert isinstance(rs.decide_egress((entry,), entry.host, 8081, ()), rs.Refused)


def test_only_listed_names_and_ports_go_out_and_a_name_that_resolves_to_nothing_is_refused() -> None:
    allowed = rs.parse_egress_allow(["api.example", "127.0.0.1:9"])
    assert rs.decide_egress(allowed, "other.example", 443, ["93.184.216.34"]) == rs.Refused(
        "other.example:443 is not on this session's egress list")
    assert isinstance(rs.decide_egress(allowed, "api.example", 80, ["93.184.216.34"]), rs.Refused)
    assert isinstance(rs.decide_egress(allowed, "127.0.0.2", 9, ()), rs.Refused)
    assert rs.decide_egress(allowed, "api.example", 443, ()) == rs.Refused("api.example does not resolve")
    assert isinstance(rs.decide_egress((), "api.example", 443, ["93.184.216.34"]), rs.Refused)


def test_every_address_of_a_name_is_tried_once_the_families_taking_turns() -> None:
    allowed = rs.parse_egress_allow(["api.example"])
    resolved = ["2606:4700::1", "2606:4700::2", "1.1.1.1", "2606:4700::3", "1.0.0.1", "1.1.1.1"]
    assert rs.decide_egress(allowed, "api.example", 443, resolved) == rs.Allowed(
        ("2606:4700::1", "1.1.1.1", "2606:4700::2", "1.0.0.1", "2606:4700::3"))
    assert rs.connect_order(["192.0.2.1", "192.0.2.2", "2001:db8::1"]) == (
        "192.0.2.1", "2001:db8::1", "192.0.2.2")  # the resolver's first family goes first
    assert rs.connect_order(["192.0.2.2", "192.0.2.1"]) == ("192.0.2.2", "192.0.2.1")
    assert rs.connect_order([]) == ()


@given(st.lists(st.ip_addresses().map(str), max_size=12))
def test_the_order_keeps_each_address_once_and_each_familys_own_order(addresses: list[str]) -> None:
    order = rs.connect_order(addresses)
    assert sorted(order) == sorted(set(addresses))
    for is_v6 in (False, True):
        family = [address for address in dict.fromkeys(addresses) if (":" in address) == is_v6]
        assert [address for address in order if (":" in address) == is_v6] == family
    assert not order or order[0] == addresses[0]


def test_no_address_reached_is_502_when_each_failed_at_once_and_504_when_time_ran_out() -> None:
    entry = rs.parse_egress_entry("api.example")
    refused = rs.ConnectFailure("192.0.2.1", 10.0, "Connection refused")
    silent = rs.ConnectFailure("2001:db8::1", 2.5)
    at_once = rs.unreached_refusal(entry, [refused, refused], 0, 30.0)
    assert (at_once.status, at_once.reason) == (502, "api.example:443 cannot be reached: "
                                                "192.0.2.1: Connection refused; 192.0.2.1: Connection refused")
    one_silent = rs.unreached_refusal(entry, [silent, refused], 0, 30.0)
    assert (one_silent.status, one_silent.reason) == (504, "api.example:443 cannot be reached: "
                                                      "2001:db8::1 did not answer in 2.5 s; 192.0.2.1: "
                                                      "Connection refused")
    untried = rs.unreached_refusal(entry, [refused], 2, 30.0)
    assert (untried.status, untried.reason) == (504, "api.example:443 cannot be reached: 192.0.2.1: "
                                                "Connection refused; 2 more not tried within 30 s in all")


# -- the proxy request parser ----------------------------------------------------------------


def test_connect_names_the_host_and_port() -> None:
    request = rs.parse_proxy_head(head("CONNECT API.example:443 HTTP/1.1", "Host: api.example:443",
                                       "User-Agent: t"))
    assert (request.kind, request.host, request.port, request.head) == (
        rs.ProxyKind.CONNECT, "api.example", 443, b"")
    assert rs.parse_proxy_head(head("CONNECT [::1]:8443 HTTP/1.1")).host == "::1"


def test_an_absolute_request_is_forwarded_in_origin_form_without_hop_by_hop_headers() -> None:
    request = rs.parse_proxy_head(head(
        "POST http://Api.Example:8080/v1/x?q=1&r=%20 HTTP/1.1", "Host: elsewhere.example",
        "Proxy-Authorization: Basic eA==", "Proxy-Connection: keep-alive", "Connection: keep-alive, X-Hop",
        "X-Hop: 1", "Keep-Alive: 5", "TE: trailers", "Upgrade: h2c", "Trailer: x",
        "Content-Length: 5", "Accept: */*", "Proxy-Anything: y"))
    assert (request.kind, request.host, request.port) == (rs.ProxyKind.FORWARD, "api.example", 8080)
    assert request.head == head("POST /v1/x?q=1&r=%20 HTTP/1.1", "host: api.example:8080",
                                "Content-Length: 5", "Accept: */*", "connection: close", "", "")
    framed = rs.parse_proxy_head(head("POST http://api.example/ HTTP/1.1", "Connection: content-length",
                                      "Content-Length: 3"))
    assert b"Content-Length: 3\r\n" in framed.head  # a body's framing is never dropped
    plain = rs.parse_proxy_head(head("GET http://api.example HTTP/1.0"))
    assert plain.port == 80 and plain.head == head("GET / HTTP/1.0", "host: api.example",
                                                   "connection: close", "", "")


@pytest.mark.parametrize(("lines", "status"), [
    (("GET /origin/form HTTP/1.1",), 400),
    (("GET https://api.example/ HTTP/1.1",), 400),
    (("GET ftp://api.example/ HTTP/1.1",), 400),
    (("GET http://user@api.example/ HTTP/1.1",), 400),
    (("GET http://api.example/#frag HTTP/1.1",), 400),
    (("GET http://api.example/a b HTTP/1.1",), 400),
    (("GET http://127.1/ HTTP/1.1",), 400),
    (("GET http://api.example:0/ HTTP/1.1",), 400),
    (("GET http://api.example/ HTTP/2",), 400),
    (("GET  http://api.example/ HTTP/1.1",), 400),
    (("GET http://api.example/",), 400),
    (("CONNECT api.example HTTP/1.1",), 400),
    (("CONNECT api.example:99999 HTTP/1.1",), 400),
    (("CONNECT http://api.example:443 HTTP/1.1",), 400),
    (("G(T http://api.example/ HTTP/1.1",), 400),
    (("GET http://api.example/ HTTP/1.1", "Bad Header: x"), 400),
    (("GET http://api.example/ HTTP/1.1", " folded: x"), 400),
    (("GET http://api.example/ HTTP/1.1", "NoColon"), 400),
    (("GET http://api.example/ HTTP/1.1", "X: a\0b"), 400),
    (("POST http://api.example/ HTTP/1.1", "Content-Length: 1", "Transfer-Encoding: chunked"), 400),
    (("POST http://api.example/ HTTP/1.1", "Content-Length: 1", "Content-Length: 2"), 400),
    (("POST http://api.example/ HTTP/1.1", "Content-Length: -1"), 400),
    (("GET http://api.example/ HTTP/1.1", "X: é"), 400),
    (("POST http://api.example/ HTTP/1.1", "Transfer-Encoding: gzip, chunked"), 400),
    (("POST http://api.example/ HTTP/1.1", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"), 400),
])
def test_malformed_or_other_requests_are_refused_with_a_reason(lines: tuple[str, ...], status: int) -> None:
    with pytest.raises(rs.EgressRefusal) as refused:
        rs.parse_proxy_head(head(*lines))
    assert refused.value.status == status and refused.value.reason


# -- one request per connection: a forwarded request's body, and nothing after it -------------

PIPELINED = b"GET /second HTTP/1.1\r\nhost: other.example\r\n\r\n"
CHUNKED = b"5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nx-trailer: 1\r\n\r\n"


def taken_in_pieces(body: rs.ForwardedBody, data: bytes, cuts: tuple[int, ...]) -> int:
    edges = (0, *cuts, len(data))
    return sum(body.take(data[start:end]) for start, end in zip(edges, edges[1:]))


@pytest.mark.parametrize(("body_bytes", "body"), [(None, CHUNKED), (7, b"1234567"), (0, b""),
                                                  (None, b"0\r\n\r\n")])
def test_a_forwarded_body_is_taken_whole_and_what_follows_is_not_however_it_is_cut(
        body_bytes: Optional[int], body: bytes) -> None:
    """Issue 42: forward mode passed a pipelined second request on unchecked. The body's own
    framing says where the request ends; every way of cutting the stream in two or three pieces
    gives the same answer."""
    data = body + PIPELINED
    for first in range(len(data) + 1):
        for second in range(first, len(data) + 1, 7):
            assert taken_in_pieces(rs.ForwardedBody(body_bytes), data, (first, second)) == len(body)
    assert rs.ForwardedBody(body_bytes).take(data) == len(body)


@pytest.mark.parametrize("broken", [b"zz\r\nhello", b"5\r\nhelloXY0\r\n\r\n", b"-5\r\n", b"\r\n",
                                    b"1" * 17 + b"\r\n", b"5;" + b"e" * 5000],
                         ids=["not hex", "no CRLF after data", "negative", "no size", "17 digits", "a long line"])
def test_a_chunked_body_that_breaks_its_framing_ends_where_it_broke(broken: bytes) -> None:
    body = rs.ForwardedBody(None)
    taken = body.take(broken + PIPELINED)
    assert taken <= len(broken) and body.take(PIPELINED) == 0


def test_the_head_says_how_the_body_is_framed() -> None:
    assert rs.parse_proxy_head(head("POST http://a.example/ HTTP/1.1", "Content-Length: 12")).body_bytes == 12
    assert rs.parse_proxy_head(head("POST http://a.example/ HTTP/1.1", "Transfer-Encoding: Chunked")
                               ).body_bytes is None
    assert rs.parse_proxy_head(head("GET http://a.example/ HTTP/1.1")).body_bytes == 0


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300) | st.text(alphabet="CONET GP:/[]@#%.-_019azAZ\r\n\t\0é", max_size=120).map(str.encode))
def test_any_head_is_a_request_or_a_refusal_never_another_error(data: bytes) -> None:
    try:
        request = rs.parse_proxy_head(data)
    except rs.EgressRefusal as e:
        assert e.status in (400, 431) and e.reason
        return
    assert rs.parse_egress_entry(str(rs.EgressEntry(request.host, request.port))) == rs.EgressEntry(
        request.host, request.port)  # what it names is an entry the allow-list can hold


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abz09-.:[]%@/ éx", max_size=40))
def test_any_entry_text_is_an_entry_or_a_value_error(text: str) -> None:
    try:
        entry = rs.parse_egress_entry(text)
    except ValueError:
        return
    assert rs.parse_egress_entry(str(entry)) == entry and 1 <= entry.port <= 65535


@given(st.ip_addresses())
def test_refused_ranges_cover_every_address_python_calls_non_global(address: object) -> None:
    """Every address ipaddress does not call global is refused for a name, save documentation
    and discard ranges (nothing answers there) and IPv6 forms that embed an IPv4 address, which
    are checked as that address (REFUSED_ADDRESSES)."""
    text = str(address)
    ip = rs.ipaddress.ip_address(text)
    documentation = [rs.ipaddress.ip_network(n) for n in (
        "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32", "2001::/23", "100::/64",
        "64:ff9b:1::/48", "::ffff:0:0/96", "2002::/16", "::/96")]
    if not ip.is_global and not any(ip.version == n.version and ip in n for n in documentation):
        assert rs.refused_range(text) is not None, text


def test_a_head_over_the_bound_is_refused() -> None:
    with pytest.raises(rs.EgressRefusal) as refused:
        rs.parse_proxy_head(head("GET http://api.example/ HTTP/1.1", "X: " + "a" * rs.MAX_EGRESS_HEAD_BYTES))
    assert refused.value.status == 431


def test_the_session_environment_points_every_client_at_the_relay_and_keeps_loopback_local() -> None:
    env = rs.EGRESS_ENVIRONMENT
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        assert env[name] == f"http://127.0.0.1:{rs.EGRESS_RELAY_PORT}"
    assert {"localhost", "127.0.0.1", "::1"} <= set(env["NO_PROXY"].split(",")) and env["no_proxy"] == env["NO_PROXY"]
    assert rs.EGRESS_RELAY_PORT != rs.MODEL_RELAY_PORT


# -- the host side on real sockets -----------------------------------------------------------


class Listener:
    """A TCP listener of the test's own on 127.0.0.1: answers each connection with `reply` after
    reading what it was sent up to a blank line, and counts the connections it saw."""

    def __init__(self, reply: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.received: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and b"ping" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.received.append(data)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
    yield server
    server.close()


class Notes:
    """The proxy's notes, as the session's events would get them (after the client saw its end)."""

    def __init__(self) -> None:
        self.notes: list[rs.EgressNote] = []
        self._changed = threading.Condition()

    def __call__(self, session_id: str, note: rs.EgressNote) -> None:
        assert session_id == "s1"
        with self._changed:
            self.notes.append(note)
            self._changed.notify_all()

    def wait(self, count: int) -> list[rs.EgressNote]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.notes) >= count, timeout=60), self.notes
            return list(self.notes)


def proxy_for(tmp_path: Path, allow: list[str], resolved: dict[str, tuple[str, ...]],
              looked_up: Optional[list[str]] = None,
              timeouts: rs.EgressTimeouts = rs.EgressTimeouts(),
              resolver: Optional[Callable[[str, int], tuple[str, ...]]] = None,
              log_window_s: float = rs.LOG_WINDOW_S) -> tuple[rs.EgressProxy, Notes, Path]:
    """A proxy on tmp_path/agent/egress.sock whose resolver answers from `resolved` (and
    records each name it was asked in looked_up), or is `resolver`, with the given time bounds."""
    notes = Notes()
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o700)

    def from_resolved(host: str, port: int) -> tuple[str, ...]:
        if looked_up is not None:
            looked_up.append(host)
        return resolved.get(host, ())
    proxy = rs.EgressProxy(notes, resolver or from_resolved, timeouts, log_window_s)
    proxy.listen("s1", agent_dir, rs.parse_egress_allow(allow))
    return proxy, notes, agent_dir / agent.EGRESS_SOCKET_NAME


def read_to_end(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def exchange(sock_path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(sock_path))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return read_to_end(sock)


def test_a_listed_literal_is_reached_by_connect_and_by_absolute_form_and_noted(
        tmp_path: Path, listener: Listener) -> None:
    proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.1:{listener.port}"], {})
    try:
        answer = exchange(path, f"CONNECT 127.0.0.1:{listener.port} HTTP/1.1\r\n\r\nping".encode())
        assert answer.startswith(b"HTTP/1.1 200 Connection established\r\n\r\n") and answer.endswith(b"hello")
        answer = exchange(path, f"GET http://127.0.0.1:{listener.port}/p?q HTTP/1.1\r\n"
                                "Proxy-Authorization: x\r\n\r\n".encode())
        assert answer.endswith(b"hello")
    finally:
        proxy.close()
    assert listener.received[0] == b"ping"
    assert listener.received[1] == (f"GET /p?q HTTP/1.1\r\nhost: 127.0.0.1:{listener.port}\r\n"
                                    "connection: close\r\n\r\n").encode()
    first, second = notes.wait(2)
    assert first == rs.EgressNote(agent.EgressDecision.ALLOWED, "127.0.0.1", listener.port, "", 4, len(listener.reply))
    assert second.decision is agent.EgressDecision.ALLOWED and second.bytes_down == len(listener.reply)
    assert path.stat().st_mode & 0o777 == 0o600


class Recording:
    """An upstream of the test's own: answers once the first request's head is in, ends its
    side, and keeps everything it received until the proxy closes the connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.ended = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(60)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            conn.shutdown(socket.SHUT_WR)
            self.received = data + read_to_end(conn)
            self.ended.set()


@pytest.mark.parametrize("framing", ["none", "content-length", "chunked"])
def test_a_pipelined_second_request_never_reaches_the_upstream(tmp_path: Path, framing: str) -> None:
    upstream = Recording()
    body, fields = {"none": (b"", ()), "content-length": (b"12345", ("Content-Length: 5",)),
                    "chunked": (CHUNKED, ("Transfer-Encoding: chunked",))}[framing]
    proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.1:{upstream.port}"], {})
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(60)
            client.connect(str(path))
            client.sendall(head(f"POST http://127.0.0.1:{upstream.port}/first HTTP/1.1", *fields, "", "")
                           + body + PIPELINED)
            answer = read_to_end(client)
        assert upstream.ended.wait(60)
    finally:
        proxy.close()
        upstream.sock.close()
    assert answer.endswith(b"\r\n\r\nok")
    sent_head = head("POST /first HTTP/1.1", f"host: 127.0.0.1:{upstream.port}", *fields, "connection: close",
                     "", "")
    assert upstream.received == sent_head + body
    assert notes.wait(1)[0].bytes_up == len(sent_head + body)


def test_unlisted_and_loopback_by_name_are_refused_403_and_never_connected(
        tmp_path: Path, listener: Listener) -> None:
    looked_up: list[str] = []
    proxy, notes, path = proxy_for(tmp_path, [f"localhost:{listener.port}"],
                                   {"localhost": ("127.0.0.1",)}, looked_up)
    try:
        unlisted = exchange(path, f"CONNECT 127.0.0.1:{listener.port} HTTP/1.1\r\n\r\n".encode())
        by_name = exchange(path, f"GET http://localhost:{listener.port}/ HTTP/1.1\r\n\r\n".encode())
        bad = exchange(path, b"GET /x HTTP/1.1\r\n\r\n")
    finally:
        proxy.close()
    assert unlisted.startswith(b"HTTP/1.1 403 ") and b"is not on this session's egress list" in unlisted
    assert by_name.startswith(b"HTTP/1.1 403 ") and b"a loopback address" in by_name
    assert bad.startswith(b"HTTP/1.1 400 ")
    assert listener.received == [] and looked_up == ["localhost"]  # the unlisted one was never looked up
    assert [(n.decision.value, n.host) for n in notes.wait(3)] == [
        ("refused", "127.0.0.1"), ("refused", "localhost"), ("refused", "")]


def test_a_flood_of_refusals_is_noted_one_by_one_then_counted_in_one_note(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 42: each refused connection was an event and a log line, however many. Now the
    first of a window are, and the rest are one note (and one line) when the window ends: here
    when the session's socket closes (a window of an hour holds the whole flood)."""
    proxy, notes, path = proxy_for(tmp_path, ["api.example"], {}, log_window_s=3600.0)
    target = "x\x1b[2J" * 2000  # 14 KiB, with an escape sequence in each piece
    try:
        for _ in range(60):
            answer = exchange(path, f"CONNECT {target}:443 HTTP/1.1\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 400 ")
        proxy.close_session("s1")
        noted = notes.wait(rs.LINES_PER_WINDOW + 1)
    finally:
        proxy.close()
    one_by_one, summary = noted[:rs.LINES_PER_WINDOW], noted[rs.LINES_PER_WINDOW]
    assert all(note.decision is agent.EgressDecision.REFUSED and note.count == 1 for note in one_by_one)
    assert summary.decision is agent.EgressDecision.REFUSED and summary.count == 60 - rs.LINES_PER_WINDOW
    assert summary.reason.startswith(f"{summary.count} more connections refused in 3.6e+03 s, not noted one "
                                     "by one; the last: egress refused :0: CONNECT needs HOST:PORT")
    assert len(notes.notes) == rs.LINES_PER_WINDOW + 1
    err = capfd.readouterr().err
    assert len(err.splitlines()) == rs.LINES_PER_WINDOW + 1 and "\x1b" not in err
    assert len(err) < (rs.LINES_PER_WINDOW + 1) * 2 * rs.MAX_LOGGED_CHARS


def test_an_upstream_that_refuses_is_a_502_with_the_reason(tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.1:{port}"], {})
    try:
        answer = exchange(path, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    finally:
        proxy.close()
    assert answer.startswith(b"HTTP/1.1 502 ") and b"cannot be reached" in answer
    assert notes.wait(1)[0].decision is agent.EgressDecision.REFUSED


def test_connections_past_the_per_session_bound_are_429(tmp_path: Path, listener: Listener) -> None:
    proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.1:{listener.port}"], {})
    tunnels = []
    try:
        for _ in range(rs.MAX_EGRESS_CONNECTIONS):
            tunnel = socket.socket(socket.AF_UNIX)
            tunnels.append(tunnel)
            tunnel.settimeout(60)
            tunnel.connect(str(path))
            tunnel.sendall(f"CONNECT 127.0.0.1:{listener.port} HTTP/1.1\r\n\r\n".encode())
            assert tunnel.recv(100).startswith(b"HTTP/1.1 200 ")  # open, and holding its slot
        one_more = exchange(path, f"CONNECT 127.0.0.1:{listener.port} HTTP/1.1\r\n\r\n".encode())
        assert one_more.startswith(b"HTTP/1.1 429 ") and b"egress connections open" in one_more
    finally:
        for tunnel in tunnels:
            tunnel.close()
        proxy.close()
    assert [n.decision for n in notes.wait(rs.MAX_EGRESS_CONNECTIONS + 1)].count(
        agent.EgressDecision.REFUSED) == 1


# -- the time bounds, and every address tried --------------------------------------------------


class Behaviour(enum.Enum):
    """What an upstream address of the test's own does with a connect."""

    ACCEPTS = "accepts"  # a listener (the test accepts or not, as it needs)
    HANGS = "hangs"  # a listener whose accept backlog is full: the kernel drops the SYN, connect waits
    REFUSES = "refuses"  # bound but not listening: connect is refused at once


@contextlib.contextmanager
def upstreams(*behaviours: Behaviour) -> Iterator[tuple[int, list[socket.socket]]]:
    """127.0.0.2, 127.0.0.3, ... (one for each behaviour) on one port, as a name's addresses
    share one: the port and each address's socket."""
    held: list[socket.socket] = []
    own: list[socket.socket] = []
    port = 0
    try:
        for index, behaviour in enumerate(behaviours):
            address = f"127.0.0.{index + 2}"
            sock = socket.socket()
            held.append(sock)
            own.append(sock)
            sock.bind((address, port))
            port = sock.getsockname()[1]
            if behaviour is Behaviour.HANGS:
                sock.listen(0)  # one connection fills it, never accepted
                held.append(socket.create_connection((address, port), timeout=60))
            elif behaviour is Behaviour.ACCEPTS:
                sock.listen(8)
        yield port, own
    finally:
        for sock in held:
            sock.close()


def nothing_waits(listener: socket.socket) -> bool:
    """No connection came to the listener (none is in its accept queue)."""
    listener.setblocking(False)
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return True
    return False


class Silent:
    """Accepts one connection and never answers: keeps what it was sent, and sets `ended` when
    its peer ended the connection (not on a reset, nor on its own timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = b""
        self.ended = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(60)
            self.received = read_to_end(conn)
            self.ended.set()


def test_an_upstream_that_never_answers_the_connect_is_a_504_after_the_bound_and_noted(
        tmp_path: Path) -> None:
    with upstreams(Behaviour.HANGS) as (port, _):
        proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.2:{port}"], {},
                                       timeouts=rs.EgressTimeouts(connect_s=0.3))
        try:
            answer = exchange(path, f"GET http://127.0.0.2:{port}/ HTTP/1.1\r\n\r\n".encode())
        finally:
            proxy.close()
    reason = f"127.0.0.2:{port} cannot be reached: 127.0.0.2 did not answer in 0.3 s"
    assert answer.startswith(b"HTTP/1.1 504 Gateway Timeout\r\n")
    assert answer.endswith(f"\r\n\r\nreploy egress proxy: {reason}\n".encode())
    assert notes.wait(1) == [rs.EgressNote(agent.EgressDecision.REFUSED, "127.0.0.2", port, reason)]


def test_a_tunnel_idle_past_its_bound_is_closed_on_both_sides_and_noted(tmp_path: Path) -> None:
    """The client never ends its side and the upstream never answers: the proxy ends both."""
    with upstreams(Behaviour.ACCEPTS) as (port, (listener,)):
        upstream = Silent(listener)
        proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.2:{port}"], {},
                                       timeouts=rs.EgressTimeouts(idle_s=0.3))
        try:
            with socket.socket(socket.AF_UNIX) as client:
                client.settimeout(60)
                client.connect(str(path))
                client.sendall(f"CONNECT 127.0.0.2:{port} HTTP/1.1\r\n\r\nping".encode())
                answer = read_to_end(client)
            assert upstream.ended.wait(60)
        finally:
            proxy.close()
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert upstream.received == b"ping"
    assert notes.wait(1) == [rs.EgressNote(
        agent.EgressDecision.ALLOWED, "127.0.0.2", port,
        "closed after 0.3 s in which no byte moved either way", bytes_up=4, bytes_down=0)]


class Flooding:
    """Accepts one connection and sends to it until the send fails; sets `ended` then."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ended = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn, contextlib.suppress(OSError):
            conn.settimeout(60)
            while True:
                conn.sendall(b"x" * 65536)
        self.ended.set()


def test_a_client_that_stops_reading_is_closed_at_the_idle_bound_and_noted(tmp_path: Path) -> None:
    """Issue 42: the upstream floods the tunnel and the client reads only the proxy's answer.
    Once the buffers between are full nothing moves: the pipe is closed at its idle bound (it
    used to wait in a send for as long as the client lived) and its event says so."""
    with upstreams(Behaviour.ACCEPTS) as (port, (listener,)):
        upstream = Flooding(listener)
        proxy, notes, path = proxy_for(tmp_path, [f"127.0.0.2:{port}"], {},
                                       timeouts=rs.EgressTimeouts(idle_s=0.5))
        try:
            with socket.socket(socket.AF_UNIX) as client:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                client.settimeout(60)
                client.connect(str(path))
                client.sendall(f"CONNECT 127.0.0.2:{port} HTTP/1.1\r\n\r\n".encode())
                [note] = notes.wait(1)  # while the client still holds its end, unread
            assert upstream.ended.wait(60)
        finally:
            proxy.close()
    assert (note.decision, note.reason) == (
        agent.EgressDecision.ALLOWED, "closed after 0.5 s in which no byte moved either way")
    assert note.bytes_down > 0


def test_a_head_that_trickles_in_past_its_bound_is_a_408_and_noted(tmp_path: Path) -> None:
    """The bound is on the whole head, not on each read: this client never waits a whole bound
    between two bytes, and is still cut off."""
    proxy, notes, path = proxy_for(tmp_path, ["api.example"], {}, timeouts=rs.EgressTimeouts(head_s=0.5))
    reason = "the request head did not come whole within 0.5 s"
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(60)
            client.connect(str(path))
            client.sendall(b"GET http://api.example/ HTTP/1.1\r\nx: ")
            for _ in range(400):  # a byte every 50 ms until the proxy answers, for 20 s at most
                if select.select([client], [], [], 0.05)[0]:
                    break
                client.sendall(b"a")
            answer = read_to_end(client)
    finally:
        proxy.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and answer.endswith(f"reploy egress proxy: {reason}\n".encode())
    assert notes.wait(1) == [rs.EgressNote(agent.EgressDecision.REFUSED, "", 0, reason)]


def test_a_lookup_that_hangs_is_a_504_within_its_bound_and_noted(tmp_path: Path) -> None:
    """getaddrinfo has no bound of its own: a resolver that never answers costs the connection the
    lookup bound, not the system resolver's retries."""
    released = threading.Event()
    proxy, notes, path = proxy_for(tmp_path, ["api.example"], {}, timeouts=rs.EgressTimeouts(resolve_s=0.3),
                                   resolver=lambda host, port: (released.wait(60), ("192.0.2.1",))[1])
    reason = "api.example did not resolve within 0.3 s"
    try:
        answer = exchange(path, b"CONNECT api.example:443 HTTP/1.1\r\nhost: api.example:443\r\n\r\n")
    finally:
        released.set()
        proxy.close()
    assert answer.startswith(b"HTTP/1.1 504 ") and answer.endswith(f"reploy egress proxy: {reason}\n".encode())
    assert notes.wait(1) == [rs.EgressNote(agent.EgressDecision.REFUSED, "api.example", 443, reason)]


def test_a_lookup_within_its_bound_is_its_resolver_s_answer() -> None:
    entry = rs.EgressEntry("api.example", 443)
    assert rs.resolve_within(lambda host, port: (f"{host}:{port}",), entry, 30) == ("api.example:443",)


def test_the_addresses_are_tried_in_order_past_one_that_hangs_and_one_that_refuses() -> None:
    with upstreams(Behaviour.HANGS, Behaviour.REFUSES, Behaviour.ACCEPTS, Behaviour.ACCEPTS) \
            as (port, (_, _, third, fourth)):
        addresses = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
        with rs.connect_upstream(rs.EgressEntry("api.example", port), addresses,
                                 rs.EgressTimeouts(connect_s=0.3)) as upstream:
            assert upstream.getpeername() == ("127.0.0.4", port)
        assert not nothing_waits(third) and nothing_waits(fourth)


def test_none_reached_is_refused_with_each_addresss_failure_in_order() -> None:
    with upstreams(Behaviour.HANGS, Behaviour.REFUSES) as (port, _):
        with pytest.raises(rs.EgressRefusal) as refused:
            rs.connect_upstream(rs.EgressEntry("api.example", port), ("127.0.0.2", "127.0.0.3"),
                                rs.EgressTimeouts(connect_s=0.3))
    assert (refused.value.status, refused.value.reason) == (
        504, f"api.example:{port} cannot be reached: 127.0.0.2 did not answer in 0.3 s; "
             "127.0.0.3: Connection refused")


def test_the_overall_bound_leaves_the_rest_untried() -> None:
    """Each attempt has the connect bound, cut to what is left of the overall one; when that
    is spent, the addresses left are not tried (the one that would answer never sees a SYN)."""
    with upstreams(Behaviour.HANGS, Behaviour.HANGS, Behaviour.ACCEPTS) as (port, (_, _, last)):
        with pytest.raises(rs.EgressRefusal) as refused:
            rs.connect_upstream(rs.EgressEntry("api.example", port),
                                ("127.0.0.2", "127.0.0.3", "127.0.0.4"),
                                rs.EgressTimeouts(connect_s=0.4, connect_total_s=0.6))
        assert nothing_waits(last)
    assert refused.value.status == 504
    assert refused.value.reason.startswith(
        f"api.example:{port} cannot be reached: 127.0.0.2 did not answer in 0.4 s; ")
    assert refused.value.reason.endswith(" more not tried within 0.6 s in all")
