"""A stack, a FIFO queue made of two stacks, and a fixed-size ring buffer."""


class EmptyError(Exception):
    """Raised when taking from an empty container."""


class Stack:
    def __init__(self, items=()):
        self._items = list(items)

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise EmptyError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        if not self._items:
            raise EmptyError("peek at an empty stack")
        return self._items[-1]

    def __len__(self):
        return len(self._items)

    def is_empty(self):
        return len(self._items) == 0


class Queue:
    """First in, first out, with amortized O(1) operations."""

    def __init__(self, items=()):
        self._inbox = list(items)
        self._outbox = []

    def enqueue(self, item):
        self._inbox.append(item)

    def _shift(self):
        if not self._outbox:
            while self._inbox:
                self._outbox.append(self._inbox.pop())

    def dequeue(self):
        self._shift()
        if not self._outbox:
            raise EmptyError("dequeue from an empty queue")
        return self._outbox.pop()

    def peek(self):
        self._shift()
        if not self._outbox:
            raise EmptyError("peek at an empty queue")
        return self._outbox[-1]

    def __len__(self):
        return len(self._inbox) + len(self._outbox)


class RingBuffer:
    """Keeps the last `capacity` items pushed; the oldest is dropped when full."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._data = [None] * capacity
        self._start = 0
        self._size = 0

    def push(self, item):
        end = (self._start + self._size) % self.capacity
        self._data[end] = item
        if self._size < self.capacity:
            self._size += 1
        else:
            self._start = (self._start + 1) % self.capacity

    def items(self):
        """The stored items, oldest first."""
        return [self._data[(self._start + i) % self.capacity] for i in range(self._size)]

    def is_full(self):
        return self._size == self.capacity

    def __len__(self):
        return self._size
