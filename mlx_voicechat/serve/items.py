"""The record of one conversation's items, which ``conversation.item.retrieve`` reads: each
item's latest state, the oldest dropped first past :data:`MAX_ITEMS` items or
:data:`MAX_ITEM_CHARS` characters of JSON (a client's items are kept as sent, so their size is
bounded here)."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Dict, List, Optional

from .wire import Event, EventSource, _new_id, invalid

MAX_ITEMS = 256  # conversation items kept for conversation.item.retrieve (the oldest go first)
MAX_ITEM_CHARS = 4 << 20  # ... and at most this much of their JSON, all together


class ItemRecord:
    """The items of one connection's conversation; its events made by ``events``."""

    def __init__(self, events: EventSource):
        self._event = events._event
        self.items: "OrderedDict[str, dict]" = OrderedDict()
        self.sizes: Dict[str, int] = {}  # item id -> characters of its JSON
        self.chars = 0
        self.last: Optional[str] = None  # the item added last
        self.before: Dict[str, Optional[str]] = {}  # item id -> the item added just before it

    def prev(self, item_id: str) -> Optional[str]:
        """The item before ``item_id`` in the conversation (``None`` for the first)."""
        return self.before.get(item_id)

    def add(self, item: dict) -> Event:
        self.before[item["id"]] = self.last
        while len(self.before) > 2 * MAX_ITEMS:  # bounded like the items (deleted ones too)
            del self.before[next(iter(self.before))]
        event = self._event("conversation.item.added", previous_item_id=self.last, item=item)
        self.last = item["id"]
        self._keep(item)
        return event

    def done(self, item: dict) -> Event:
        """An item's final state, kept for ``retrieve`` and sent."""
        self._keep(item)
        previous = self.prev(item["id"])
        return self._event("conversation.item.done", previous_item_id=previous, item=item)

    def _keep(self, item: dict) -> None:
        if item["id"] in self.items:
            self._forget(item["id"])
        size = len(json.dumps(item, ensure_ascii=False))
        self.items[item["id"]] = item
        self.sizes[item["id"]] = size
        self.chars += size
        while len(self.items) > MAX_ITEMS or (self.chars > MAX_ITEM_CHARS and len(self.items) > 1):
            self._forget(next(iter(self.items)))

    def _forget(self, item_id: str) -> None:
        del self.items[item_id]
        self.chars -= self.sizes.pop(item_id)

    # -- the client's item events --

    def client_item(self, item: dict, kind: str, **fields) -> List[Event]:
        """A client's item into the conversation: ``conversation.item.added`` and ``.done``."""
        given = item.get("id")
        item_id = given if isinstance(given, str) and 0 < len(given) <= 64 else _new_id("item")
        done = {k: v for k, v in item.items() if k not in ("id", "object", "status")}
        done.update(id=item_id, object="realtime.item", type=kind, status="completed", **fields)
        return [self.add(done), self.done(done)]

    def _known(self, event: dict) -> str:
        item_id = event.get("item_id")
        if not isinstance(item_id, str) or item_id not in self.items:
            raise invalid(f"no item {str(item_id)[:80]!r} in this conversation", "item_id")
        return item_id

    def retrieve(self, event: dict):
        item = self.items[self._known(event)]
        return [self._event("conversation.item.retrieved", item=item)], []

    def delete(self, event: dict):
        """Forget an item (the model heard what it heard: only the record goes; a system or
        developer message's text stays in the instructions)."""
        item_id = self._known(event)
        self._forget(item_id)
        return [self._event("conversation.item.deleted", item_id=item_id)], []
