"""The streaming_parser kata's conformances: each ``conform_*`` function returns an
instance of a stage class as the Protocol of ``katas/streaming_parser/api.py`` it
implements (see tests/test_conformance.py)."""

from __future__ import annotations

import katas.streaming_parser.stage1 as sp_stub1
import katas.streaming_parser.stage2 as sp_stub2
import katas.streaming_parser.stage3 as sp_stub3
import solutions.streaming_parser.stage1 as sp_ref1
import solutions.streaming_parser.stage2 as sp_ref2
import solutions.streaming_parser.stage3 as sp_ref3
from katas.streaming_parser import api as sp

# --- stage 1: the parser and the chat assembler -----------------------------------------


def conform_stub_event_stream_parser(x: sp_stub1.EventStreamParser) -> sp.EventParser:
    return x


def conform_ref_event_stream_parser(x: sp_ref1.EventStreamParser) -> sp.EventParser:
    return x


def conform_stub_chat_stream_assembler(x: sp_stub1.ChatStreamAssembler) -> sp.ChatAssembler:
    return x


def conform_ref_chat_stream_assembler(x: sp_ref1.ChatStreamAssembler) -> sp.ChatAssembler:
    return x


# --- stage 2: the mux and the streams it opens ------------------------------------------


def conform_stub_stream_mux(x: sp_stub2.StreamMux) -> sp.Multiplexer:
    return x


def conform_ref_stream_mux(x: sp_ref2.StreamMux) -> sp.Multiplexer:
    return x


def conform_stub_event_stream(x: sp_stub2.EventStream) -> sp.MuxedStream:
    return x


def conform_ref_event_stream(x: sp_ref2.EventStream) -> sp.MuxedStream:
    return x


# --- stage 3: the resumable source ------------------------------------------------------


def conform_stub_resumable_event_source(x: sp_stub3.ResumableEventSource) -> sp.EventSource:
    return x


def conform_ref_resumable_event_source(x: sp_ref3.ResumableEventSource) -> sp.EventSource:
    return x
