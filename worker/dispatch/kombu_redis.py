"""Two repairs to kombu's Redis transport, so a worker lives through a Redis restart.

The failure (issue 33): with ``acks_late`` messages unacked, a Redis that goes down made the
worker's consumer die with ``Unrecoverable error: AttributeError("'NoneType' object has no
attribute 'hostname'")``. The cause, read in kombu 5.7 and reproduced with plain kombu
(``tests/faults/test_redis_restart.py``):

1. Celery's ``Consumer.on_connection_error_after_connected`` calls ``Connection.collect()``,
   which closes the default channel (the one consuming the task queues), then every channel
   of the transport (``virtual.Transport.close_connection``), then sets the transport's
   ``client`` to None, and then ``Connection.close()``, which closes the default channel again.
2. The default channel's first close fails at once: its BRPOP is in flight and reading it
   raises ``ConnectionError``, before the channel marks itself closed.
   ``close_connection`` would close it again (that works), but it closes the channels last
   created first and stops at the first that raises: the pidbox's channel (our workers run
   without gossip and mingle, so the pidbox's is the only other channel that consumes) sends
   ``PUNSUBSCRIBE`` on its subscriber connection. Whether that raises depends on whether the
   event loop has already read that socket's EOF: a race, hence "4 of 4 runs" on one machine
   and "0 of 2" on another.
3. When it raises, the default channel is left open while ``collect`` drops the transport's
   ``client``. ``Connection.close()`` then closes it, and the close tries to put its
   unacked messages back (``QoS.restore_unacked_once``). That needs a Redis client, whose
   parameters come from ``channel.connection.client``, which is now None: ``AttributeError``.
   That is not a connection error, so Celery treats it as unrecoverable and stops the worker.

Repairs, applied once at import of ``worker.dispatch.app``:
- ``close_connection`` closes every channel even when one raises, and gives a channel whose
  close raised a connection error one more try (its failed BRPOP read is cleared by then),
  so nothing is left open for ``Connection.close()`` to close without a client.
- A channel keeps the connection settings it was opened with. A channel that has lost its
  transport (closed, or collected after a broker loss) still makes clients from them. That
  is what lets a task that outlives the reconnect ack its message afterwards: the ack goes
  to the restarted Redis, not into an ``AttributeError`` swallowed in a task thread.

Celery's own switches do not avoid the failure without a cost we will not pay:
``worker_enable_remote_control=False`` removes the pidbox, and with it ``specbatch cancel``'s
abort and Flower's worker views; ``worker_cancel_long_running_tasks_on_connection_loss``
cancels the very jobs that should go on generating.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

_APPLIED = "_specbatch_repaired"


class _Origin:
    """What ``Channel._connparams`` reads from a channel's transport: its kombu connection
    (``client``: host, port, password, TLS) and default port."""

    __slots__ = ("client", "default_port")

    def __init__(self, client: Any, default_port: int) -> None:
        self.client = client
        self.default_port = default_port


def close_every_channel(transport: Any, connection: Any) -> None:
    """``Transport.close_connection`` that closes every channel, whatever one of them raises."""
    transport.cycle.close()
    for channels in (transport._avail_channels, transport.channels):
        while channels:
            try:
                channel = channels.pop()
            except LookupError:  # another thread took it meanwhile
                break
            close_channel(channel, transport.connection_errors)


def close_channel(channel: Any, errors: tuple[type[BaseException], ...]) -> None:
    """Close ``channel``; after a connection error, try once more if it is still open."""
    for attempt in (1, 2):
        try:
            channel.close()
            return
        except errors as exc:
            if getattr(channel, "closed", True) or attempt == 2:
                log.debug("closing a channel of a lost broker connection: %r", exc)
                return


def _connparams_with_origin(original: Any) -> Any:
    def _connparams(self: Any, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.__dict__.get("connection")
        if transport is not None and getattr(transport, "client", None) is not None:
            if "_specbatch_origin" not in self.__dict__:
                self._specbatch_origin = _Origin(transport.client, transport.default_port)
            return original(self, asynchronous)
        origin = self.__dict__.get("_specbatch_origin")
        if origin is None:  # never connected: nothing to fall back on
            return original(self, asynchronous)
        # A shallow copy whose transport is the origin: other threads may use this channel
        # (late acks), so its own ``connection`` attribute is never swapped, even briefly.
        view = copy.copy(self)
        view.__dict__["connection"] = origin
        return original(view, asynchronous)

    return _connparams


def apply() -> None:
    """Install both repairs on kombu's Redis transport (and its Sentinel subclass); idempotent."""
    if getattr(kombu_redis.Transport, _APPLIED, False):
        return
    kombu_redis.Transport.close_connection = close_every_channel
    kombu_redis.Channel._connparams = _connparams_with_origin(kombu_redis.Channel._connparams)
    setattr(kombu_redis.Transport, _APPLIED, True)
