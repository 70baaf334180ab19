"""A read worker: a thread that owns one stream reader, reads one step ahead of the trainer, and
answers for its state in one of two ways.

- A round trip (``state()``): the trainer asks and waits while the worker builds its state (for a
  token buffer of many MB, turning it into a tensor is most of the wait). A read-ahead may be
  under way when it asks, so the worker answers with the state *before* that read-ahead, which is
  where the trainer stands.
- Prefetched (paper section 4.5): a read-ahead requested with ``snapshot=True`` also builds the
  state right after its item, during the trainer's previous step; the trainer receives the state
  with the item and collecting it at the checkpoint step costs nothing.

The reader is any object with ``next_item()``, ``state()`` (after the last item) and
``state_before_last(item)`` (exactly as it was before producing ``item``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol


class StreamReader(Protocol):
    def next_item(self) -> Any: ...

    def state(self) -> Any: ...

    def state_before_last(self, item: Any) -> Any: ...


_NEXT, _STATE, _STOP = "next", "state", "stop"


class ReadWorker:
    """One read worker thread over ``reader``; used from one thread (the trainer's)."""

    def __init__(self, reader: StreamReader, name: str) -> None:
        self.reader = reader
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._ahead = 0  # items requested and not yet taken
        self._arrived: tuple[Any, Any] | None = None  # an item that arrived before a state reply
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def request_next(self, snapshot: bool) -> None:
        """Start reading the next item (and, with ``snapshot``, the state right after it); one item
        ahead at most, since the state before a read-ahead is rebuilt from the last item alone."""
        if self._ahead:
            raise RuntimeError("a read worker reads one item ahead at most")
        self._requests.put((_NEXT, snapshot))
        self._ahead += 1

    @property
    def ahead(self) -> int:
        """Items requested and not yet taken (0 or 1)."""
        return self._ahead

    def take(self) -> tuple[Any, Any]:
        """The item requested last and its snapshot (None unless requested)."""
        if not self._ahead:
            raise RuntimeError("take() without a request_next()")
        arrived, self._arrived = self._arrived, None
        item = arrived if arrived is not None else self._reply()
        self._ahead -= 1
        return item

    def ask_state(self) -> None:
        """First half of a round trip: ask for the state where the trainer stands."""
        self._requests.put((_STATE, self._ahead))

    def answer_state(self) -> Any:
        """Second half: wait for the answer (an item under way arrives first and is kept for ``take``)."""
        if self._ahead and self._arrived is None:
            self._arrived = self._reply()
        return self._reply()

    def stop(self) -> None:
        self._requests.put((_STOP, None))
        self._thread.join()

    def _reply(self) -> Any:
        reply = self._replies.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def _serve(self) -> None:
        last = None
        while True:
            kind, argument = self._requests.get()
            if kind == _STOP:
                return
            try:
                if kind == _NEXT:
                    last = self.reader.next_item()
                    self._replies.put((last, self.reader.state() if argument else None))
                else:  # argument: whether the last item is a read-ahead the trainer has not taken
                    self._replies.put(self.reader.state_before_last(last) if argument else self.reader.state())
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
                self._replies.put(exc)
