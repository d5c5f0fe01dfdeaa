"""Responses kept for GET /v1/responses/{id} and for continuing with `previous_response_id`, in
memory, bounded by count and by bytes: the oldest is evicted first. A response is kept with its
whole conversation (its input items after the previous response's, and its output items), so a
continuation needs only the one it names, and evicting an older one breaks no later one."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vlmserve.errors import APIError

logger = logging.getLogger("vlmserve.api")
MAX_ID_SHOWN = 256


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as the client got it
    conversation: list[dict[str, Any]]  # input items, then output items: what a continuation extends
    nbytes: int


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `response` (by its id), evicting the oldest past either bound; one larger than
        the byte bound alone is not kept (a later lookup says so)."""
        if self.max_entries == 0:
            return
        nbytes = len(json.dumps(response)) + len(json.dumps(conversation))  # ASCII: characters are bytes
        if nbytes > self.max_bytes:
            logger.warning(
                "response %s (%d bytes) not stored: over the store's %d-byte bound (--responses-store-max-bytes)",
                response["id"],
                nbytes,
                self.max_bytes,
            )
            return
        self._pop(response["id"])
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes):
            self._pop(next(iter(self._entries)))
        self._entries[response["id"]] = StoredResponse(response, conversation, nbytes)
        self.nbytes += nbytes

    def get(self, response_id: str, param: str) -> StoredResponse:
        """The stored response, or a 404 naming the id (never stored, or evicted) and `param`."""
        entry = self._entries.get(response_id)
        if entry is None:
            shown = response_id if len(response_id) <= MAX_ID_SHOWN else response_id[:MAX_ID_SHOWN] + "..."
            raise APIError(
                404,
                f"Response with id '{shown}' not found: it was not stored (store false, or an unknown id) or was "
                f"evicted (the server keeps the {self.max_entries} most recent responses, up to {self.max_bytes} "
                "bytes: --responses-store-max-entries, --responses-store-max-bytes)",
                param,
                "not_found",
                "NotFoundError",
            )
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        self._pop(response_id)

    def _pop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
