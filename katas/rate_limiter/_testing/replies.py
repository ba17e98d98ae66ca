"""Holding a call right after Redis has answered it, before the code under test sees the reply.

What a race between a reply in flight and another thread's call needs: the command has
run on the server, its reply is read off the socket, and the calling thread waits at a
gate until the test lets the reply through.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis.connection

from katas._harness.interleave import Gate


def hold_after_reply(monkeypatch: pytest.MonkeyPatch, gate: Gate, thread_name: str) -> None:
    """Every reply the thread named ``thread_name`` reads passes through ``gate`` once read
    (a gate with ``limit=1`` holds only its first)."""
    original = redis.connection.AbstractConnection.read_response

    def read_response(self: redis.connection.AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        reply = original(self, *args, **kwargs)
        if threading.current_thread().name == thread_name:
            gate.pass_through()
        return reply

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
