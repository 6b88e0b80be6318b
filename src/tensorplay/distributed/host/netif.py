"""Which address and network interface this host uses to reach another address (stdlib only).

The fix people paste by hand when a multi-host job fails with gloo's "Connection refused,
remote=[127.0.0.1]" is "the interface that routes to the master". This module finds it:

    route_to("198.18.0.1")     # Route(address='198.18.0.2', interface='tpx_h2'), from host B
    route_to("127.0.0.1")      # Route(address='127.0.0.1', interface='lo')

The source address is the one the kernel would choose (a UDP socket's connect sends nothing);
the interface is the one holding that address (Linux: SIOCGIFADDR). IPv4 only; None where the
address cannot be resolved or routed, or the interface cannot be found.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import socket
import struct
import time
from dataclasses import dataclass

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class Route:
    """The source address this host uses toward a destination, and its interface."""

    address: str
    interface: str

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def route_to(host: str, port: int = 9) -> Route | None:
    """The address and interface this host would use to reach ``host`` (IPv4), or None."""
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, port))
            address = probe.getsockname()[0]
    except OSError:
        return None
    interface = interface_of(address)
    return None if interface is None else Route(address, interface)


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address``, or None."""
    return next((name for name, held in interface_addresses().items() if held == address), None)


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one (Linux)."""
    import fcntl

    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
    return found


def is_local(host: str) -> bool:
    """Whether ``host`` names an address of this host (loopback or one of its interfaces)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return ipaddress.ip_address(address).is_loopback or address in interface_addresses().values()


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to ``host:port`` alone and listening (OSError when it cannot).

    ``TCPStore(is_master=True)`` alone would listen on every interface of the machine; a store
    served on this socket is reachable from where the ranks are and from nowhere else.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(max(128, backlog))
    except OSError:
        listener.close()
        raise
    return listener


def refuses(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether ``host:port`` refuses a TCP connection: its server is gone, the host is up.
    False when it accepts, or cannot be reached in ``timeout_s`` (not known to be gone)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def await_listener(host: str, port: int, deadline: float) -> str | None:
    """Probe ``host:port`` with plain connects until one succeeds (None) or ``deadline``
    passes (the last error, e.g. 'Connection refused').

    A TCPStore client refused by a server that is not listening yet backs off (250-420 ms
    measured with torch 2.13) and logs each failed try with a C++ trace; probing with short,
    growing pauses (2 ms to 250 ms, jittered) meets the server within milliseconds, so torch's
    client only ever meets a listening store.
    """
    pause = 0.002
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(max(left, 0.05), 1.0)):
                return None
        except OSError as err:
            if left <= 0:
                return err.strerror or str(err)
            time.sleep(min(pause * (0.5 + random.random()), max(left, 0.0)))
            pause = min(pause * 2, 0.25)
