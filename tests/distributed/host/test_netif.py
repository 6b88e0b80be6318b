"""The route to an address: the source address the kernel picks, and its interface."""

from __future__ import annotations

from tensorplay.distributed.host import netif


def test_loopback_is_reached_through_the_loopback_interface():
    route = netif.route_to("127.0.0.1")
    assert route is not None and route.is_loopback
    assert route.address == "127.0.0.1"
    assert netif.interface_addresses()[route.interface] == "127.0.0.1"


def test_every_interface_address_maps_back_to_its_interface():
    addresses = netif.interface_addresses()
    assert addresses  # at least the loopback
    for name, address in addresses.items():
        assert netif.interface_of(address) == name
        assert netif.is_local(address)


def test_an_unresolvable_host_has_no_route():
    assert netif.route_to("no-such-host.invalid") is None
    assert not netif.is_local("no-such-host.invalid")
