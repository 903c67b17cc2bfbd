"""Which failed dials reached nobody (the uplink is down) and are retried soon, not backed off (issue 20)."""

from __future__ import annotations

import errno
import ssl

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from agent.dialler import unreachable

KEY = ConnectionKey("gw", 10262, True, True, None, None, None)


def connector_error(code: int) -> aiohttp.ClientConnectorError:
    return aiohttp.ClientConnectorError(KEY, OSError(code, "x"))


@pytest.mark.parametrize("exc", [
    aiohttp.ConnectionTimeoutError("connect timed out"),
    connector_error(errno.ENETUNREACH),
    connector_error(errno.EHOSTUNREACH),
    connector_error(errno.ENETDOWN),
    OSError(errno.ENETUNREACH, "Network is unreachable"),
])
def test_nothing_reached_the_gateway(exc: BaseException) -> None:
    assert unreachable(exc)


@pytest.mark.parametrize("exc", [
    connector_error(errno.ECONNREFUSED),  # a host answered: the gateway is restarting, back off
    TimeoutError(),  # the whole dial's deadline: TCP connected, TLS or the upgrade were slow
    aiohttp.ServerDisconnectedError(),
    ssl.SSLError("bad certificate"),
    OSError(errno.ECONNRESET, "reset"),
    aiohttp.SocketTimeoutError("read timed out"),
])
def test_the_gateway_was_reached(exc: BaseException) -> None:
    assert not unreachable(exc)
