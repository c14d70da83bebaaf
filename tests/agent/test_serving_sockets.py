"""The in-process servers' sockets (mosaic.serving): accepted connections have Nagle's algorithm off.

With it on, a response written in two pieces (headers, then body) waits for the client's delayed ACK:
about 40 ms per request on loopback, twice per model call through the recording proxy. asyncio turns it
off only on sockets whose ``proto`` is TCP, so the listening socket must be made with it."""

from __future__ import annotations

import asyncio
import socket

from mosaic.serving import bind


def test_accepted_connections_have_nodelay():
    async def main() -> int:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future = loop.create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = bind("127.0.0.1", 0)
        sock.listen(8)
        server = await loop.create_server(Proto, sock=sock)  # as uvicorn serves a pre-bound socket
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            flag = await asyncio.wait_for(seen, 10)
            writer.close()
            return flag
        finally:
            server.close()

    assert bind("127.0.0.1", 0).proto == socket.IPPROTO_TCP
    assert asyncio.run(main()) != 0
