"""The Responses API's store (tokenloom/server/serving_responses.py): stored responses by id, in memory in
the API process, at most TOKENLOOM_RESPONSES_STORE_SIZE of them (the least recently used go first)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.server.responses_background import EventLog


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as sent
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation, its output included
    events: EventLog | None = None  # a streamed background response's events (GET ?stream=true)


class ResponseStore:
    """Stored responses by id, at most `capacity` (0: none); get and put make a response the most recent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
