"""The dynamic_batcher kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/dynamic_batcher/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

import katas.dynamic_batcher.stage1 as db_stub1
import katas.dynamic_batcher.stage2 as db_stub2
import katas.dynamic_batcher.stage3 as db_stub3
import solutions.dynamic_batcher.stage1 as db_ref1
import solutions.dynamic_batcher.stage2 as db_ref2
import solutions.dynamic_batcher.stage3 as db_ref3
from katas.dynamic_batcher import api as db
from katas.dynamic_batcher._testing.fleet import SimCompletion
from katas.dynamic_batcher._testing.http_link import HttpLink
from katas.dynamic_batcher._testing.model import FakeModel
from katas.dynamic_batcher._testing.replica_client import CompletionStream

# --- dynamic_batcher: both batchers are what simulate() drives; the model is the harness's


def conform_stub_continuous_batcher(x: db_stub1.ContinuousBatcher) -> db.Batcher:
    return x


def conform_ref_continuous_batcher(x: db_ref1.ContinuousBatcher) -> db.Batcher:
    return x


def conform_stub_static_batcher(x: db_stub1.StaticBatcher) -> db.Batcher:
    return x


def conform_ref_static_batcher(x: db_ref1.StaticBatcher) -> db.Batcher:
    return x


def conform_stub_prefix_caching_batcher(x: db_stub2.PrefixCachingBatcher) -> db.Batcher:
    return x


def conform_ref_prefix_caching_batcher(x: db_ref2.PrefixCachingBatcher) -> db.Batcher:
    return x


def conform_stub_token_stream(x: db_stub2._Stream) -> db.TokenStream:
    return x


def conform_ref_token_stream(x: db_ref2._Stream) -> db.TokenStream:
    return x


def conform_stub_routed_stream(x: db_stub3._RoutedStream) -> db.TokenStream:
    return x


def conform_ref_routed_stream(x: db_ref3._RoutedStream) -> db.TokenStream:
    return x


def conform_harness_fake_model(x: FakeModel) -> db.Model:
    return x  # a Protocol the kata calls and the harness implements: no stub, no reference


def conform_harness_http_link(x: HttpLink) -> db.ReplicaLink:
    return x  # the router calls links; the harness implements them, over HTTP and in process


def conform_harness_completion_stream(x: CompletionStream) -> db.Completion:
    return x


def conform_harness_sim_completion(x: SimCompletion) -> db.Completion:
    return x
