"""The dynamic_batcher kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/dynamic_batcher/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

# tests/test_conformance.py reads these annotations at run time and needs classes there;
# mypy checks the request batcher with its type parameters.
if TYPE_CHECKING:
    StubDynamicBatcher = db_stub2.DynamicBatcher[int, str]
    RefDynamicBatcher = db_ref2.DynamicBatcher[int, str]
    RequestBatcher = db.RequestBatcher[int, str]
else:
    StubDynamicBatcher = db_stub2.DynamicBatcher
    RefDynamicBatcher = db_ref2.DynamicBatcher
    RequestBatcher = db.RequestBatcher

# --- dynamic_batcher: both batchers are what simulate() drives; the model is the harness's;
# the continuous one is a paged batcher too, as the tests read it


def conform_stub_continuous_batcher(x: db_stub1.ContinuousBatcher) -> db.PagedBatcher:
    return x


def conform_ref_continuous_batcher(x: db_ref1.ContinuousBatcher) -> db.PagedBatcher:
    return x


def conform_stub_static_batcher(x: db_stub1.StaticBatcher) -> db.Batcher:
    return x


def conform_ref_static_batcher(x: db_ref1.StaticBatcher) -> db.Batcher:
    return x


def conform_stub_prefix_caching_batcher(x: db_stub2.PrefixCachingBatcher) -> db.CachingBatcher:
    return x


def conform_ref_prefix_caching_batcher(x: db_ref2.PrefixCachingBatcher) -> db.CachingBatcher:
    return x


# --- stage 2's engine and request batcher; stage 3's routing policy and router


def conform_stub_async_engine(x: db_stub2.AsyncEngine) -> db.Engine:
    return x


def conform_ref_async_engine(x: db_ref2.AsyncEngine) -> db.Engine:
    return x


def conform_stub_dynamic_batcher(x: StubDynamicBatcher) -> RequestBatcher:
    return x


def conform_ref_dynamic_batcher(x: RefDynamicBatcher) -> RequestBatcher:
    return x


def conform_stub_replica_set(x: db_stub3.ReplicaSet) -> db.RoutingPolicy:
    return x


def conform_ref_replica_set(x: db_ref3.ReplicaSet) -> db.RoutingPolicy:
    return x


def conform_stub_router(x: db_stub3.Router) -> db.StreamRouter:
    return x


def conform_ref_router(x: db_ref3.Router) -> db.StreamRouter:
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
