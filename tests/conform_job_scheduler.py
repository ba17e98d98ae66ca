"""The job_scheduler kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/job_scheduler/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

import katas.job_scheduler.stage1 as js_stub1
import katas.job_scheduler.stage2 as js_stub2
import katas.job_scheduler.stage3 as js_stub3
import solutions.job_scheduler.stage1 as js_ref1
import solutions.job_scheduler.stage2 as js_ref2
import solutions.job_scheduler.stage3 as js_ref3
from katas.job_scheduler import api as js

# --- job_scheduler: the queues ----------------------------------------------------------


def conform_stub_job_queue(x: js_stub1.JobQueue) -> js.JobQueue:
    return x


def conform_ref_job_queue(x: js_ref1.JobQueue) -> js.JobQueue:
    return x


def conform_stub_redis_job_queue(x: js_stub3.RedisJobQueue) -> js.SharedJobQueue:
    return x


def conform_ref_redis_job_queue(x: js_ref3.RedisJobQueue) -> js.SharedJobQueue:
    return x


# --- job_scheduler: the effect stores ---------------------------------------------------


def conform_stub_memory_effect_store(x: js_stub1.MemoryEffectStore) -> js.EffectStore:
    return x


def conform_ref_memory_effect_store(x: js_ref1.MemoryEffectStore) -> js.EffectStore:
    return x


def conform_stub_redis_effect_store(x: js_stub3.RedisEffectStore) -> js.EffectStore:
    return x


def conform_ref_redis_effect_store(x: js_ref3.RedisEffectStore) -> js.EffectStore:
    return x


# --- job_scheduler: the pools and the worker --------------------------------------------


def conform_stub_thread_worker_pool(x: js_stub2.ThreadWorkerPool) -> js.WorkerPool:
    return x


def conform_ref_thread_worker_pool(x: js_ref2.ThreadWorkerPool) -> js.WorkerPool:
    return x


def conform_stub_async_worker_pool(x: js_stub2.AsyncWorkerPool) -> js.AsyncWorkerPool:
    return x


def conform_ref_async_worker_pool(x: js_ref2.AsyncWorkerPool) -> js.AsyncWorkerPool:
    return x


def conform_stub_redis_worker(x: js_stub3.RedisWorker) -> js.Worker:
    return x


def conform_ref_redis_worker(x: js_ref3.RedisWorker) -> js.Worker:
    return x
