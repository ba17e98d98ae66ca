"""Stage 3 suite, core edges: a node's life at the exact instants the rules turn on (see
katas/kv_cache/README.md). The examples and the state machine are in test_stage3.py.

Every test here puts ``n0`` behind a fault proxy (``_testing/shards.py``,
``n0_behind_a_proxy``): an outage resets its connections at once and keeps its data, on
fakeredis and on a real server alike; the probe interval (1 s) runs on a ManualClock, so
nothing waits. A call is held before its command is sent with a ``HoldBefore``
(``_testing/wire.py``): sent before a node went down, answered after.

The map of this file:

- coming back: a call sent before n0 was marked down, answered after, never brings it
  back under its old epoch (only a probe does, under a new one);
- the probe interval: a failed probe made late starts its interval at that probe; two
  calls failing at the same instant start one interval;
- each call on a failing node is sent once: no retry that doubles a timeout or runs a
  write script twice (a refused connection, a BUSY reply);
- delete's answer with a replica unreachable: False when no reachable replica held it;
- a value JSON refuses is refused even when every replica is down;
- reclaiming old epochs on every kind of call: puts and deletes too, not only gets;
  under a key prefix holding the characters SCAN's MATCH reads as a pattern, without
  touching a neighbour's keys; and copies written under an epoch while an older
  one's walk goes on, that epoch retired before the walk ends (each walked whole).
"""

from __future__ import annotations

import pytest

from katas._harness.marks import core, rule
from katas._harness.redis import RedisEnv
from katas._harness.story import check, expect
from katas._harness.waiting import DEADLINE_S, spawn
from katas.kv_cache._testing.rings import fail_fast_on_stubs  # noqa: F401 (autouse)
from katas.kv_cache._testing.shards import (
    CALLS,
    MISS,
    after_100_calls,
    n0_behind_a_proxy,
    next_probe_of_n0_in,
    node_stats,
    unencodable,
)
from katas.kv_cache._testing.wire import EVERY_COMMAND, HoldBefore, Sent
from katas.kv_cache.api import NS_PER_S, NoReplicaAvailable

pytestmark = [pytest.mark.stage(3)]


@core
@rule("rejoin-new-epoch", "never-older")
@pytest.mark.parametrize("op", list(CALLS))
def test_stage3_a_call_sent_before_a_node_went_down_does_not_bring_it_back(
    redis_env: RedisEnv, op: str
) -> None:
    """A call on n0 is on its way when n0 fails and is marked down; a put then skips n0.
    n0 answers again, and the call that was on its way succeeds — under the epoch it was
    sent with. Only a probe, made after the mark, brings n0 back, under a new epoch: n0
    still holds, under its old one, the value the put skipped."""
    n0 = n0_behind_a_proxy(redis_env)
    cache = n0.cache
    key, other = n0.keys_at(0, 2)
    held = HoldBefore(n0.client, *EVERY_COMMAND)
    cache.put(key, "old")
    held.arm()
    slow = spawn(lambda: CALLS[op](cache, other), f"{op}({other!r})")
    check(held.reached.wait(DEADLINE_S), f"{op}({other!r}) must send a command to n0 first")
    n0.proxy.outage()
    cache.get(key)  # n0 fails: marked down, its next probe 1 s from now
    cache.put(key, "new")  # skips n0: only the other replica takes it
    n0.proxy.heal()
    held.release.set()
    slow.outcome(f"the {op} held on its way to n0 returns once n0 answers")
    got = cache.get(key, MISS)
    s = node_stats(cache, "n0")
    story = (
        f"put({key!r}, 'old'); a {op}({other!r}) is on its way to n0 (its first replica); n0 "
        f"fails a get and is marked down; put({key!r}, 'new') skips it; n0 answers again and "
        f"the {op} sent before the mark succeeds, at the same instant"
    )
    check(
        got == "new",
        f"{story}; then get({key!r}): n0 holds 'old' under the epoch the {op} was sent with — "
        f"a call sent before n0 went down is no probe, and must not bring it back under that "
        f"epoch (it stays down until a probe takes a new one). Expected 'new', got "
        f"{'MISS' if got is MISS else repr(got)}; n0: {s}",
    )
    n0.clock.advance(NS_PER_S)
    got = cache.get(key, MISS)
    s = node_stats(cache, "n0")
    check(
        got == "new" and (s.epoch, s.down) == (1, False),
        f"{story}; 1 s later a get probes n0: it comes back under epoch 1, misses, and the "
        f"other replica answers 'new'; got {'MISS' if got is MISS else repr(got)}, n0: {s}",
    )


@core
@rule("failed-probe", "probe-interval")
@pytest.mark.parametrize("op", list(CALLS))
def test_stage3_a_late_failed_probe_starts_its_interval_at_that_probe(
    redis_env: RedisEnv, op: str
) -> None:
    n0 = n0_behind_a_proxy(redis_env)
    cache, clock = n0.cache, n0.clock
    key = n0.keys_at(0)[0]
    n0.proxy.outage()
    cache.get(key)  # at 0: n0 fails, down; probed from 1 s on
    clock.advance(NS_PER_S + NS_PER_S // 2)
    CALLS[op](cache, key)  # at 1.5 s, the first call since: a late probe, which fails
    story = (
        f"n0 (the first replica of {key!r}) fails a get at 0 s; nothing touches it until a "
        f"{op} at 1.5 s probes it, and fails: its next interval ends 1 s after that probe, "
        f"at 2.5 s, not 1 s after the deadline it was probed past"
    )
    expect(node_stats(cache, "n0").errors, 2, f"{story}: n0's errors after the late probe")
    next_probe_of_n0_in(cache, clock, lambda: CALLS[op](cache, key), NS_PER_S, 2, story)


@core
@rule("probe-interval", "failed-probe")
@pytest.mark.parametrize("op", list(CALLS))
def test_stage3_two_calls_failing_at_once_start_one_interval(redis_env: RedisEnv, op: str) -> None:
    """A call is on its way to n0 when n0 fails another; it fails too, at the same
    instant. The node failed at that instant, twice: it is probed 1 s later, not 2 s."""
    n0 = n0_behind_a_proxy(redis_env)
    cache, clock = n0.cache, n0.clock
    key, other = n0.keys_at(0, 2)
    held = HoldBefore(n0.client, *EVERY_COMMAND)
    held.arm()
    slow = spawn(lambda: CALLS[op](cache, other), f"{op}({other!r})")
    check(held.reached.wait(DEADLINE_S), f"{op}({other!r}) must send a command to n0 first")
    n0.proxy.outage()
    cache.get(key)  # at 0: n0 fails, down
    held.release.set()
    slow.outcome(f"the {op} held on its way to n0 returns")  # at 0 too: it fails as well
    story = (
        f"a {op}({other!r}) is on its way to n0 when a get of {key!r} finds n0 failing and "
        f"marks it down; the {op} then fails too, at the same instant (0 s). n0 failed at 0 s: "
        f"it is not tried before 1 s, and tried at 1 s"
    )
    expect(node_stats(cache, "n0").errors, 2, f"{story}: n0's errors after both failed")
    next_probe_of_n0_in(cache, clock, lambda: cache.get(key), NS_PER_S, 2, story)


@core
@rule("client-contract", "one-timeout", "busy-unavailable")
@pytest.mark.parametrize("fault", ["outage", "busy"])
@pytest.mark.parametrize("op", list(CALLS))
def test_stage3_a_failing_node_is_sent_each_call_once(
    redis_env: RedisEnv, op: str, fault: str
) -> None:
    """No retry in the cache either: a retried read waits out its timeout twice, and a
    retried write whose reply was lost runs its script twice."""
    n0 = n0_behind_a_proxy(redis_env)
    cache = n0.cache
    key = n0.keys_at(0)[0]
    cache.put(key, "v")
    sent = Sent(n0.client)
    n0.proxy.outage() if fault == "outage" else n0.proxy.busy()
    CALLS[op](cache, key)  # n0 fails: down
    first = sent.naming(key)
    n0.clock.advance(NS_PER_S)
    CALLS[op](cache, key)  # the probe: n0 fails again
    probe = sent.naming(key)[len(first) :]
    s = node_stats(cache, "n0")
    failure = "resets every connection" if fault == "outage" else "answers BUSY to every command"
    check(
        (len(first), len(probe), s.errors) == (1, 1, 2),
        f"n0 (the first replica of {key!r}) {failure}; a {op} of {key!r} fails there, and 1 s "
        f"later a {op} probes it and fails again. Each call sends n0 its command once and "
        f"counts one error: a failure is an answer, failed over at once (a retry doubles a "
        f"timeout, and runs a write twice when only its reply was lost). Commands naming "
        f"{key!r} sent to n0 by the first {op}: {first}; by the probe: {probe}; n0: {s}",
    )


@core
@rule("round-trip", "writes-need-one-replica")
@pytest.mark.parametrize("channel", [None, "invalidations"], ids=["plain", "publishing"])
@pytest.mark.parametrize("position", [0, 1], ids=["first-replica-down", "second-replica-down"])
def test_stage3_delete_is_false_when_no_reachable_replica_held_the_key(
    redis_env: RedisEnv, position: int, channel: str | None
) -> None:
    n0 = n0_behind_a_proxy(redis_env, channel=channel)
    cache = n0.cache
    held, never, never_again = n0.keys_at(position, 3)
    cache.put(held, "v")
    n0.proxy.outage()
    got = [cache.delete(never), cache.delete(never_again), cache.delete(held)]
    which = "first" if position == 0 else "second"
    check(
        got == [False, False, True],
        f"n0 is the {which} replica of each key, and unreachable. delete of {never!r} (never "
        f"written; n0 fails it), of {never_again!r} (never written; n0 skipped, down) and of "
        f"{held!r} (written before, so its live replica holds it): a delete is True if a "
        f"replica held the key, False when none did — an unreachable replica is no replica "
        f"that held it. Expected [False, False, True], got {got}",
    )


@core
@rule("round-trip", "writes-need-one-replica")
@pytest.mark.parametrize("channel", [None, "invalidations"], ids=["plain", "publishing"])
def test_stage3_a_value_json_refuses_is_refused_even_with_every_replica_down(
    redis_env: RedisEnv, channel: str | None
) -> None:
    n0 = n0_behind_a_proxy(redis_env, replicas=1, channel=channel)
    cache = n0.cache
    key = n0.keys_at(0)[0]
    n0.proxy.outage()
    cache.get(key)  # n0, the key's only replica, is marked down
    instants = {"n0 down and skipped": 0, "n0 due for a probe, still failing": NS_PER_S}
    for instant, advance in instants.items():
        n0.clock.advance(advance)
        for what, value in unencodable().items():
            with pytest.raises((TypeError, NoReplicaAvailable)) as refused:
                cache.put(key, value)
            check(
                refused.type is TypeError and "value" in str(refused.value),
                f"replicas=1; {key!r} lives on n0 alone, which is unreachable ({instant}). "
                f"put({key!r}, <{what}>) must raise TypeError naming value: a value JSON "
                f"refuses is refused first, whether or not a replica could take it; got "
                f"{refused.type.__name__}: {refused.value}",
            )
    with pytest.raises(NoReplicaAvailable):
        cache.put(key, "fine")
        pytest.fail(f"put({key!r}, 'fine') with its only replica down must raise")


@core
@rule("reclaim-old-epochs")
@pytest.mark.parametrize("op", ["put", "delete"])
def test_stage3_writes_reclaim_old_copies_too(redis_env: RedisEnv, op: str) -> None:
    base = redis_env.fresh_prefix()
    # The cache's keys sort after 1 000 that are not its own: no single page reclaims all.
    n0 = n0_behind_a_proxy(redis_env, prefix=f"{base}z:")
    cache, server = n0.cache, n0.servers["n0"]
    on_n0 = n0.store_docs()  # copies on n0 under epoch 0
    server.client().mset({f"{base}a:{i:04}": "other" for i in range(1000)})
    n0.marked_down(on_n0[0])
    n0.clock.advance(NS_PER_S)
    # The first of these probes n0, which comes back under epoch 1; each later one sweeps.
    epoch, stale = after_100_calls(redis_env, cache, server, n0.prefix, on_n0, CALLS[op])
    kept = len(redis_env.keys(f"{base}a:", node=server))
    check(
        epoch == 1 and not stale and kept == 1000,
        f"n0 held its copies under epoch 0 among 1 000 keys that are not the cache's; it was "
        f"marked down, and a {op} found it back under epoch 1, followed by 99 more {op}s on "
        f"it. Every later call on a node reclaims a batch of what its abandoned epoch holds — "
        f"a {op} as much as a get, for a node may only be written to. Expected epoch 1, no "
        f"key of an older epoch and the 1 000 others untouched; got epoch {epoch}, "
        f"{len(stale)} old copies ({[k.removeprefix(n0.prefix) for k in stale[:4]]}), "
        f"{kept} others",
    )


#: Key prefixes holding what SCAN's MATCH reads as a pattern, each with the prefix of a
#: neighbour on the same node whose keys that prefix, read as a pattern, would match.
GLOB_PREFIXES = {
    "star": ("c*", "cc"),
    "question-mark": ("c?", "cc"),
    "brackets": ("c[c]", "cc"),
    "backslash": ("c\\", "c"),
}


@core
@rule("reclaim-old-epochs")
@pytest.mark.parametrize("prefix", list(GLOB_PREFIXES.values()), ids=list(GLOB_PREFIXES))
def test_stage3_old_copies_are_reclaimed_whatever_the_key_prefix_holds(
    redis_env: RedisEnv, prefix: tuple[str, str]
) -> None:
    """A key prefix may hold any character, those a MATCH pattern reads as a glob too:
    the sweep reclaims the copies under that very prefix — all of them, and nothing of
    a neighbour whose keys the prefix, read as a pattern, would match."""
    base = redis_env.fresh_prefix()
    glob, neighbour = prefix
    n0 = n0_behind_a_proxy(redis_env, prefix=f"{base}{glob}:")
    cache, server = n0.cache, n0.servers["n0"]
    on_n0 = n0.store_docs()  # copies on n0 under epoch 0
    # Another cache's copies under epoch 0, on the same node.
    server.client().mset({f"{base}{neighbour}:0:doc:{i}": "theirs" for i in range(100)})
    n0.marked_down(on_n0[0])
    n0.clock.advance(NS_PER_S)
    epoch, stale = after_100_calls(redis_env, cache, server, n0.prefix, on_n0)
    kept = len(redis_env.keys(f"{base}{neighbour}:", node=server))
    check(
        epoch == 1 and not stale and kept == 100,
        f"key_prefix={glob + ':'!r} (its copies named like {cache.key_name('n0', 'doc:0')!r}); "
        f"n0 holds them under epoch 0 beside 100 keys of a neighbour under "
        f"{neighbour + ':0:'!r}. n0 was marked down and came back under epoch 1, then 100 "
        f"more calls reached it: the copies of epoch 0 under that very prefix are reclaimed "
        f"(a MATCH pattern takes the prefix literally, its *, ?, [ and \\ escaped), the "
        f"neighbour's keys left alone. Expected epoch 1, no old copy and 100 keys of the "
        f"neighbour; got epoch {epoch}, {len(stale)} old copies "
        f"({[k.removeprefix(n0.prefix) for k in stale[:4]]}), {kept} of the neighbour's",
    )


@core
@rule("reclaim-old-epochs", "rejoin-new-epoch")
def test_stage3_copies_written_while_an_older_epoch_is_walked_are_reclaimed(
    redis_env: RedisEnv,
) -> None:
    """n0 comes back under epoch 1, and writes reach it under that epoch while the walk
    of epoch 0's copies goes on, a page per call; before that walk ends n0 comes back
    again, under epoch 2. Each abandoned epoch is walked whole, from its own start: a
    walk of epoch 1 taken up where epoch 0's left off never meets the copies written
    behind that cursor, nor — a SCAN returns what was there when its walk began — those
    written after it began."""
    base = redis_env.fresh_prefix()
    # The cache's keys sort after 1 000 that are not its own: its walks take several pages.
    n0 = n0_behind_a_proxy(redis_env, prefix=f"{base}z:", probe_interval_ns=0)
    cache, server = n0.cache, n0.servers["n0"]
    server.client().mset({f"{base}a:{i:04}": "other" for i in range(1000)})
    on_n0 = n0.store_docs()  # copies on n0 under epoch 0

    def rejoin(probe: str) -> None:
        n0.marked_down(on_n0[0])
        CALLS[probe](cache, on_n0[0])  # ... and back, under the next epoch

    rejoin("put")  # epoch 1, the probe writing under it; a first page of epoch 0's walk
    for key in on_n0[1:4]:
        cache.put(key, "v1")  # copies under epoch 1, each put a page more of that walk
    rejoin("get")  # epoch 2, before epoch 0's walk could end
    epoch, stale = after_100_calls(redis_env, cache, server, n0.prefix, on_n0)
    kept = len(redis_env.keys(f"{base}a:", node=server))
    check(
        epoch == 2 and not stale and kept == 1000,
        f"n0 (1 000 keys that are not the cache's, scanned first) held copies under epoch 0; "
        f"it came back under epoch 1 (the probe a put), and 3 more puts wrote copies under "
        f"epoch 1 while the walk of epoch 0 went on, a page per call; then it came back "
        f"under epoch 2 before that walk ended. After 100 more calls on n0 expected epoch 2, "
        f"no copy of epoch 0 or 1 (each walked whole, from its own start) and the 1 000 "
        f"others untouched; got epoch {epoch}, {len(stale)} old copies "
        f"({[k.removeprefix(n0.prefix) for k in stale[:4]]}), {kept} others",
    )
