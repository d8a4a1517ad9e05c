"""A receive loop ends when it is cancelled, even as a message wakes it.

Python 3.11's ``asyncio.wait_for`` returns the result instead of raising when the
cancellation lands in the same loop iteration as the wake-up; a broker whose receive
loop swallowed its stop kept serving after SIGTERM until it was killed.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from zps import transport


@pytest.mark.timeout(30)
async def test_a_cancel_that_lands_with_a_wake_up_ends_the_receive() -> None:
    ctx = transport.new_context()
    a = ctx.socket(zmq.PAIR)
    a.bind("inproc://cancel")
    b = ctx.socket(zmq.PAIR)
    b.connect("inproc://cancel")
    ch = transport.Channel(a)
    try:
        for _ in range(50):
            task = asyncio.create_task(ch.recv_burst(0.5))
            await asyncio.sleep(0)  # parked in the timed wait
            await asyncio.sleep(0)
            ch._readable.set()  # the reader's wake-up ...
            task.cancel()  # ... and the stop, in one loop iteration
            with pytest.raises(asyncio.CancelledError):
                await task
            ch._readable.clear()
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
