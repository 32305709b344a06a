from minilib.structures import EmptyError, Queue, RingBuffer, Stack


def _raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return True
    return False


def test_stack_lifo():
    s = Stack()
    s.push(1)
    s.push(2)
    s.push(3)
    assert s.pop() == 3
    assert s.pop() == 2
    assert len(s) == 1


def test_stack_peek_keeps_item():
    s = Stack([1, 2])
    assert s.peek() == 2
    assert len(s) == 2


def test_stack_empty():
    s = Stack()
    assert s.is_empty()
    assert _raises(EmptyError, s.pop)
    assert _raises(EmptyError, s.peek)
    s.push(0)
    assert not s.is_empty()


def test_queue_fifo():
    q = Queue()
    for i in range(4):
        q.enqueue(i)
    assert [q.dequeue() for _ in range(4)] == [0, 1, 2, 3]


def test_queue_interleaved():
    q = Queue([1, 2])
    assert q.dequeue() == 1
    q.enqueue(3)
    assert q.dequeue() == 2
    assert q.peek() == 3
    assert len(q) == 1


def test_queue_empty():
    q = Queue()
    assert _raises(EmptyError, q.dequeue)
    assert _raises(EmptyError, q.peek)
    assert len(q) == 0


def test_ring_buffer_fills():
    r = RingBuffer(3)
    r.push("a")
    r.push("b")
    assert r.items() == ["a", "b"]
    assert not r.is_full()
    r.push("c")
    assert r.is_full()


def test_ring_buffer_overwrites_oldest():
    r = RingBuffer(3)
    for x in range(5):
        r.push(x)
    assert r.items() == [2, 3, 4]
    assert len(r) == 3


def test_ring_buffer_capacity_one():
    r = RingBuffer(1)
    r.push(1)
    r.push(2)
    assert r.items() == [2]


def test_ring_buffer_bad_capacity():
    assert _raises(ValueError, RingBuffer, 0)
