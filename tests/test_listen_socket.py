"""The pre-bound listening socket (tokenloom/server/listen.py) must give uvicorn's connections TCP_NODELAY,
as a socket uvicorn binds itself does: asyncio sets it only on sockets whose proto says TCP. Without it every
HTTP response waited ~40 ms on Nagle + delayed ACK (headers and body are written separately)."""

from __future__ import annotations

import asyncio
import socket

from tokenloom.server.listen import bind_socket


def test_connections_accepted_on_the_pre_bound_socket_have_tcp_nodelay() -> None:
    sock = bind_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP

    async def main() -> int:
        seen: dict[str, int] = {}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen["nodelay"] = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        await reader.read()  # until the server closes the connection
        writer.close()
        server.close()
        await server.wait_closed()
        return seen["nodelay"]

    assert asyncio.run(main()) != 0
