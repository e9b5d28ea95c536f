"""TCPStores that listen on one address, not on all of them.

PyTorch's TCPStore server listens on every address of the machine whatever host it is given
(``TCPStore("10.0.0.5", 0, is_master=True)`` accepts connections on ``*:port``). A rank's
stores belong on the address its agent advertises, inside the job's network (docs/security.md,
"What listens where"), so the server is handed a socket already bound there
(``master_listen_fd``).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout


def listening_store(host: str, port: int = 0, *,
                    timeout: timedelta = default_pg_timeout) -> dist.TCPStore:
    """A TCPStore server listening on ``host``:``port`` only (``port`` 0: any free one, read it
    from ``.port``)."""
    listener = _bound_socket(host, port)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now
    return store


def replica_store(host: str, port: int, *, serve: bool,
                  timeout: timedelta = default_pg_timeout) -> dist.TCPStore:
    """The store of a replica's own process group: served by its rank 0 on ``host``:``port``
    (the agent's ``MASTER_ADDR`` and ``MASTER_PORT``), a client of it on the other ranks."""
    if serve:
        return listening_store(host, port, timeout=timeout)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def _bound_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r} to listen on ({e}): give the agent an "
                         "--advertise-address that names this machine") from e
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as e:
        listener.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror}): the agent's "
                      "advertised address must be one of this machine's own, and the port "
                      "free") from e
    return listener
