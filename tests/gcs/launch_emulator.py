"""Starts gcp-storage-emulator on 127.0.0.1, a port the OS picks, objects in memory, and prints
``listening on http://127.0.0.1:PORT`` once it serves (its own command line takes a fixed port
only)."""

from __future__ import annotations

import logging
import sys
import threading

from gcp_storage_emulator.server import create_server

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    host, port = server._api._httpd.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    threading.Event().wait()  # served by the server's thread until the process is ended
