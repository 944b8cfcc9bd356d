"""A TCP proxy on 127.0.0.1 in front of the test server that can lose the connection for real:
once ``cut_after`` bytes have gone towards the server (or ``cut_after_down`` towards the client)
it resets every connection, so requests in flight break; with ``refuse`` it also stops
listening, so new ones are refused (a lost link), else it goes on serving (a dropped socket).

It can also stall, as a server that hangs does, in one of the ``MODES`` (set ``mode``, or give
``stall_after``: the mode starts once that many bytes have gone towards the server):
"freeze" forwards nothing more either way; "headers" forwards, on each connection, the headers
of the next answer and then nothing; "drip" forwards the answers one byte every ``drip_every``
seconds (each socket read gets a byte: no read timeout ever fires). Connections stay open
until ``close``."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

MODES = ("pass", "freeze", "headers", "drip")


class FaultProxy:
    def __init__(self, target: tuple[str, int], cut_after: int | None = None, cut_after_down: int | None = None,
                 refuse: bool = True, stall: str = "pass", stall_after: int = 0, drip_every: float = 0.5) -> None:
        assert stall in MODES, stall
        self.target, self.refuse = target, refuse
        self.stall, self.stall_after, self.drip_every = stall, stall_after, drip_every
        self.closed = threading.Event()
        self.limits = {True: cut_after, False: cut_after_down}
        self.moved = {True: 0, False: 0}  # bytes forwarded towards the server (True) and the client
        self.cut = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not (self.cut.is_set() and self.refuse):
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                if self.cut.is_set() and self.refuse:
                    client.close()
                    upstream.close()
                    return
                self._socks += [client, upstream]
            for src, dst, counted in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, counted), daemon=True)
                self._threads.append(t)
                t.start()

    @property
    def mode(self) -> str:
        """The mode in force: ``stall`` once ``stall_after`` bytes have gone towards the server."""
        with self._lock:
            return self.stall if self.moved[True] >= self.stall_after else "pass"

    @mode.setter
    def mode(self, mode: str) -> None:
        assert mode in MODES, mode
        with self._lock:
            self.stall, self.stall_after = mode, 0

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        tail = b""  # the last bytes forwarded towards the client in "headers" mode (an end may straddle two)
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(1 << 16)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                mode = self.mode
                with self._lock:
                    self.moved[upward] += len(data)
                    limit = self.limits[upward]
                    trip = limit is not None and self.moved[upward] >= limit and not self.cut.is_set()
                if trip:
                    self.lose_connection()
                    return
                if mode == "freeze":
                    break
                if mode == "headers" and not upward:
                    end = (tail + data).find(b"\r\n\r\n")
                    if end >= 0:
                        dst.sendall(data[: max(0, end + 4 - len(tail))])
                        break
                    tail = (tail + data)[-3:]
                if mode == "drip" and not upward:
                    for i in range(len(data)):
                        dst.sendall(data[i : i + 1])
                        if self.closed.wait(self.drip_every):
                            return
                    continue
                dst.sendall(data)
            self.closed.wait()  # stalled: the connection stays open, silent, until the proxy closes

    def lose_connection(self) -> None:
        """Reset every connection (RST, as a dropped link shows) and refuse new ones."""
        with self._lock:
            self.cut.set()
            socks, self._socks = self._socks, []
        if self.refuse:
            with contextlib.suppress(OSError):
                self._listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RD)  # wakes this proxy's own reader of it
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()

    def close(self) -> None:
        self.closed.set()
        self.refuse = True
        self.lose_connection()
        with contextlib.suppress(OSError):
            self._listener.close()
        for t in self._threads:
            t.join(5)
