"""The waiting queue, in policy order: FCFS (a deque) or priority (a heap on (priority, arrival))."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from tokenloom.core.request import Request


def priority_key(request: Request) -> tuple[int, float, str]:
    """Lower is served first; the same key picks the priority victim (the largest)."""
    return (request.priority, request.arrival_time, request.request_id)


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        """A preempted request goes back to the front: it was admitted before everyone waiting."""
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._queue.extendleft(reversed(list(requests)))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __getitem__(self, index: int) -> Request:
        # vLLM's FCFS queue is a deque: waiting[i] is the i-th in line.
        return self._queue[index]

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Heap on (priority, arrival_time, request_id). There is no front: a preempted request
    simply re-enters at its key."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], int, Request]] = []
        self._counter = 0  # unique tiebreak so Requests are never compared

    def add_request(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (priority_key(request), self._counter, request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def peek_request(self) -> Request:
        return self._heap[0][2]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[2]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In service order (sorted copy; for inspection, not the hot path)."""
        return iter(e[2] for e in sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "fcfs":
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
