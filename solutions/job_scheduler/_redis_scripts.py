"""The Lua behind stage 3: one script per transition, each one EVALSHA (one round trip).

Stage 1's rules, restated on Redis. Every script starts the same way (``PRELUDE``):

1. ``now`` from the server's ``TIME``, in integer µs (about 1.7·10¹⁵, exact in a Lua
   double below 2^53). No client clock is ever read: workers' clocks disagree.
2. ``op = INCR ops``: the queue's operation counter. Redis runs scripts one at a time,
   so ``op`` is the order the transitions happened in; every reply carries ``op`` and
   ``now``, and the suite replays a run through an exact model in that order.
3. ``settle(now)``: what time made due, in stage 1's order — lease expiries in
   ``(expires_at, seq)`` order (each costs the attempt its claim counted, and its
   backoff runs from the expiry), then delayed jobs whose time has come, then retention
   of finished jobs and idempotency records. Each step is bounded (``LIMIT``), so one
   call never blocks the server for long; what is left is settled by the next call.
   The reaper is this prelude and nothing else.

Keys share the hash tag of the queue's name (``q:{jobs}:…``), so in Redis Cluster one
queue lives in one slot and a script may touch all of them. ``KEYS[1]`` is that prefix
(it routes the call to the slot); every key is derived from it. ``ARGV[1]`` is the
queue's settings, encoded once as one string; ``ARGV[2]`` the client's seed for the
queue's generator (below). Each argument costs the client an encode and the server a
parse, on every call.

Cost. A script is cheap next to its round trip only if it does little: a call with
nothing due must not scan. ``wake`` holds a lower bound on the earliest time anything
becomes due (a lease expiry, a delayed job, a retention deadline); every script that
adds such a time lowers it, and ``settle`` runs only once ``now`` reaches it, then
recomputes it. Fields that only mean something in one state (``exp``/``wid`` while
leased) are left behind on leaving it rather than deleted: the reader ignores them.

- ``ready``: sorted set, score ``-priority``, member ``"<due µs, 16 digits>:<seq, 12
  digits>"``. Equal scores sort by member, byte by byte, so ``ZPOPMIN`` pops the highest
  priority, then the earliest due, then the oldest — the payload is never compared.
- ``delayed``: score due µs, member ``<seq, 12 digits>``; ``leases``: score expiry µs,
  same members, so equal expiries come out by seq.
- ``forget``: every finished job, scored by when it finished (retention trims it);
  ``succeeded``/``cancelled``: sets; ``dead``: sorted by a death counter (the order of
  death, for ``dead_letters``); ``idemx``: idempotency records by expiry (for counting).
- ``gen``: the store's generation, the server's µs when it was created (job ids carry
  it: ``job-7@1764640000123456``, so a store lost and started again never reissues one).
- A job's hash: ``id``, ``p`` payload (JSON), ``pr`` priority, ``due``, ``seq``, ``att``
  attempts, ``tok`` fencing token, ``st`` state, ``max`` max_attempts, ``enq``,
  ``exp``/``wid`` (while leased), ``fin`` (while finished), ``err``, ``res`` (JSON),
  ``prev`` (decorrelated jitter's previous delay), ``eff`` (the committed effect, JSON).
  The effect lives in the job's own hash: keyed by job id, never by (job, token), and
  forgotten with the job.

Retention by TTL, set by the script that finishes a job (``PEXPIREAT`` at finish +
retention) or records a key (``SET … PX``): a crash between two calls can never leave
one behind forever. The indexes of finished jobs and of records expire when their newest
member does, so an idle queue holds its live jobs and five small keys (``seq``, ``gen``,
``ops``, ``wake``, ``rng``), nothing more. Pending jobs have no TTL — they are the queue.

Jitter needs randomness the server can reproduce: a Park–Miller generator (exact in
doubles) whose state the queue keeps in ``rng``. It is seeded from the injected ``rng``
of the client whose call draws first (each client draws its seed once, when built), and
only a backoff advances it — so, as in stage 1, a read or a refused call draws nothing,
and a run's delays depend on its retries alone.
"""

from __future__ import annotations

#: ARGV[1] (settings) and ARGV[2] (seed) come first; a script's own arguments follow.
COMMON_ARGS = 2

PRELUDE = r"""
local unpack = unpack or table.unpack
local P = KEYS[1]  -- the prefix, e.g. q:{jobs}: (its hash tag routes the call)
local K_SEQ, K_OPS, K_WAKE = P .. 'seq', P .. 'ops', P .. 'wake'
local K_READY, K_DELAYED, K_LEASES = P .. 'ready', P .. 'delayed', P .. 'leases'
local K_FORGET, K_SUCCEEDED, K_DEAD = P .. 'forget', P .. 'succeeded', P .. 'dead'
local K_CANCELLED, K_DEATHS, K_IDEMX = P .. 'cancelled', P .. 'deaths', P .. 'idemx'
local LEASE, MAX_ATT, BASE, CAP, JITTER, RETENTION, DEDUP =
  string.match(ARGV[1], '^(%d+) (%d+) (%d+) (%d+) (%a+) (%d+) (%d+)$')
LEASE, MAX_ATT, BASE, CAP = tonumber(LEASE), tonumber(MAX_ATT), tonumber(BASE), tonumber(CAP)
RETENTION, DEDUP = tonumber(RETENTION), tonumber(DEDUP)
local LIMIT = 1000  -- the most of each kind one call settles
local NEVER = 9000000000000000  -- µs, in the year 2255: "nothing is due, ever"

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local op = redis.call('INCR', K_OPS)
local wake = tonumber(redis.call('GET', K_WAKE) or 0)  -- missing (new, or flushed): settle
local K_GEN = P .. 'gen'
local GEN = redis.call('GET', K_GEN) or ''  -- the store's generation (see job_id)

local function int(x) return string.format('%d', x) end
local function pad(x, w) return string.format('%0' .. w .. 'd', x) end
local function member(seq) return pad(seq, 12) end
local function ready_member(due, seq) return pad(due, 16) .. ':' .. pad(seq, 12) end
-- A job's id carries the store's generation: the server's time (µs) when the store was
-- created. A store that was lost (a restart without persistence) starts again at job 1,
-- but under a new generation, so a zombie's lease on an old job-7 never fence-checks
-- against the new one: its id names no job any more.
local function job_id(seq) return 'job-' .. int(seq) .. '@' .. GEN end
local function job_key(seq) return P .. 'job:' .. job_id(seq) end
local function num(jk, field) return tonumber(redis.call('HGET', jk, field)) end

-- Park–Miller (minimal standard): products stay below 2^47, exact in doubles. Its state
-- lives in the store, read on the first draw and written back after each one.
local K_RNG, seed = P .. 'rng', nil
local function rnd31()
  seed = seed or tonumber(redis.call('GET', K_RNG) or ARGV[2])
  seed = (seed * 48271) % 2147483647
  redis.call('SET', K_RNG, int(seed))
  return seed
end
local function randrange(lo, hi)  -- an integer in [lo, hi)
  local n = hi - lo
  if n <= 1 then return lo end
  local r = (rnd31() % 4194304) * 2147483648 + rnd31()  -- 53 random bits at most
  return lo + math.fmod(r, n)
end

local function backoff(jk, attempt)
  if JITTER == 'decorrelated' then
    local prev = num(jk, 'prev') or BASE
    local d = math.min(CAP, randrange(BASE, 3 * prev + 1))
    redis.call('HSET', jk, 'prev', int(d))
    return d
  end
  local d = 0
  if BASE > 0 then d = math.min(CAP, BASE * 2 ^ math.min(attempt - 1, 60)) end
  if JITTER == 'none' then return d end
  if JITTER == 'full' then return randrange(0, d + 1) end
  local half = math.floor(d / 2)  -- equal
  return half + randrange(0, half + 1)
end

-- Something becomes due at `at`: keep `wake` at or below it.
local function due_at(at)
  if at < wake then
    wake = at
    redis.call('SET', K_WAKE, int(at))
  end
end

local function make_ready(jk, seq, due)
  redis.call('HSET', jk, 'st', 'ready')
  redis.call('ZADD', K_READY, -num(jk, 'pr'), ready_member(due, seq))
end

-- Wait for `due`: READY at once if due, else SCHEDULED in the delayed set.
local function schedule(jk, seq, due)
  if due <= now then
    redis.call('HSET', jk, 'due', int(due))
    make_ready(jk, seq, due)
  else
    redis.call('HSET', jk, 'due', int(due), 'st', 'scheduled')
    redis.call('ZADD', K_DELAYED, due, member(seq))
    due_at(due)
  end
end

local function expire_at(k, us) redis.call('PEXPIREAT', k, int(math.ceil(us / 1000))) end

local function finish(jk, seq, state, at)
  redis.call('HSET', jk, 'st', state, 'fin', int(at))
  redis.call('ZADD', K_FORGET, at, member(seq))
  due_at(at + RETENTION)
  local index = K_CANCELLED
  if state == 'dead' then
    index = K_DEAD
    redis.call('ZADD', K_DEAD, redis.call('INCR', K_DEATHS), member(seq))
    expire_at(K_DEATHS, now + RETENTION)
  elseif state == 'succeeded' then index = K_SUCCEEDED; redis.call('SADD', index, member(seq))
  else redis.call('SADD', index, member(seq)) end
  -- Redis forgets the hash by itself; settle drops the indexes' entry at the same instant.
  expire_at(jk, at + RETENTION)
  -- Every member of these indexes finished at or before now, so at now + RETENTION all of
  -- them are past their retention: the index goes then too, and a queue left idle shrinks
  -- to its live jobs with no call to settle it.
  expire_at(K_FORGET, now + RETENTION)
  expire_at(index, now + RETENTION)
end

-- A leased attempt failed at `at`: retry after backoff, or die after max_attempts.
local function fail(jk, seq, err, at)
  redis.call('HSET', jk, 'err', err)
  local attempts = num(jk, 'att')
  if attempts >= num(jk, 'max') then finish(jk, seq, 'dead', at)
  else schedule(jk, seq, at + backoff(jk, attempts)) end
end

local function settle()
  local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'WITHSCORES',
                             'LIMIT', 0, LIMIT)
  for i = 1, #expired, 2 do
    local seq = tonumber(expired[i])
    redis.call('ZREM', K_LEASES, expired[i])
    fail(job_key(seq), seq, 'lease expired', tonumber(expired[i + 1]))
  end
  local due = redis.call('ZRANGEBYSCORE', K_DELAYED, '-inf', now, 'LIMIT', 0, LIMIT)
  for i = 1, #due do
    local seq = tonumber(due[i])
    local jk = job_key(seq)
    redis.call('ZREM', K_DELAYED, due[i])
    make_ready(jk, seq, num(jk, 'due'))
  end
  local old = redis.call('ZRANGEBYSCORE', K_FORGET, '-inf', now - RETENTION, 'LIMIT', 0, LIMIT)
  for i = 1, #old do
    redis.call('ZREM', K_FORGET, old[i])
    redis.call('SREM', K_SUCCEEDED, old[i])
    redis.call('SREM', K_CANCELLED, old[i])
    redis.call('ZREM', K_DEAD, old[i])
    redis.call('DEL', job_key(tonumber(old[i])))
  end
  -- The next time anything is due, from scratch (what is left past LIMIT: now).
  wake = math.huge
  for _, k in ipairs({K_LEASES, K_DELAYED, K_FORGET}) do
    local first = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
    if #first > 0 then
      local at = tonumber(first[2])
      if k == K_FORGET then at = at + RETENTION end
      if at < wake then wake = at end
    end
  end
  if wake == math.huge then wake = NEVER end
  redis.call('SET', K_WAKE, int(wake))
  return #expired / 2
end

local expired_now = 0
if now >= wake then expired_now = settle() end  -- else nothing can be due: no scans

local function pending()
  return redis.call('ZCARD', K_READY) + redis.call('ZCARD', K_DELAYED)
         + redis.call('ZCARD', K_LEASES)
end

-- The job a lease names, if that lease is live: its key and seq, or an error reply.
local function live(id, token)
  local jk = P .. 'job:' .. id
  local st, tok, seq = unpack(redis.call('HMGET', jk, 'st', 'tok', 'seq'))
  if not st then return nil, {op, now, 'notfound'} end
  if st ~= 'leased' or tonumber(tok) ~= tonumber(token) then
    return nil, {op, now, 'stale', st, tonumber(tok)}
  end
  return jk, tonumber(seq)
end
"""

# ARGV[3..]: payload JSON, priority, due µs ('' = now), delay µs ('' = none),
# idempotency key ('' = none), max_pending ('' = unbounded).
ENQUEUE = r"""
local payload, priority, run_at, delay = ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local ikey, max_pending = ARGV[7], ARGV[8]
local ik = P .. 'idem:' .. ikey
if ikey ~= '' then
  local known = redis.call('GET', ik)
  if known then
    local id, expiry = string.match(known, '(%S+) (%d+)')
    if tonumber(expiry) > now then return {op, now, 'dup', id} end
  end
end
if max_pending ~= '' and pending() >= tonumber(max_pending) then return {op, now, 'full'} end
if GEN == '' then GEN = int(now); redis.call('SET', K_GEN, GEN) end  -- a new store
local seq = redis.call('INCR', K_SEQ)
local id = job_id(seq)
local jk = P .. 'job:' .. id
local due = now
if run_at ~= '' then due = tonumber(run_at) elseif delay ~= '' then due = now + tonumber(delay) end
redis.call('HSET', jk, 'id', id, 'p', payload, 'pr', int(priority), 'seq', int(seq),
           'att', 0, 'tok', 0, 'max', int(MAX_ATT), 'enq', int(now))
schedule(jk, seq, due)
if ikey ~= '' and DEDUP > 0 then
  -- The record's expiry is counted from the first enqueue only; SET ... PX writes the
  -- value and its TTL in one command.
  redis.call('SET', ik, id .. ' ' .. int(now + DEDUP), 'PX', int(math.ceil(DEDUP / 1000)))
  redis.call('ZREMRANGEBYSCORE', K_IDEMX, '-inf', now)  -- the index of live records only
  redis.call('ZADD', K_IDEMX, now + DEDUP, ikey)
  expire_at(K_IDEMX, now + DEDUP)  -- the newest record outlives every other one
end
return {op, now, 'ok', id}
"""

# ARGV[3]: worker id.
CLAIM = r"""
local top = redis.call('ZPOPMIN', K_READY)
if #top == 0 then return {op, now, 'none'} end
local seq = tonumber(string.sub(top[1], 18))
local jk = job_key(seq)
local expires = now + LEASE
local att, tok = unpack(redis.call('HMGET', jk, 'att', 'tok'))
local attempt, token = tonumber(att) + 1, tonumber(tok) + 1  -- bumped on every claim, never reset
redis.call('HSET', jk, 'st', 'leased', 'att', attempt, 'tok', token, 'exp', int(expires),
           'wid', ARGV[3])
redis.call('ZADD', K_LEASES, expires, member(seq))
due_at(expires)
return {op, now, 'ok', job_id(seq), token, attempt, expires}
"""

# ARGV[3..]: job id, token, result JSON.
ACK = r"""
local jk, seq = live(ARGV[3], ARGV[4])
if not jk then return seq end
redis.call('ZREM', K_LEASES, member(seq))
redis.call('HSET', jk, 'res', ARGV[5])
finish(jk, seq, 'succeeded', now)
return {op, now, 'ok'}
"""

# ARGV[3..]: job id, token, error.
NACK = r"""
local jk, seq = live(ARGV[3], ARGV[4])
if not jk then return seq end
redis.call('ZREM', K_LEASES, member(seq))
fail(jk, seq, ARGV[5], now)
return {op, now, 'ok'}
"""

# ARGV[3..]: job id, token. An expired lease was settled above: it is never revived.
HEARTBEAT = r"""
local jk, seq = live(ARGV[3], ARGV[4])
if not jk then return seq end
local expires = now + LEASE
redis.call('HSET', jk, 'exp', int(expires))
redis.call('ZADD', K_LEASES, expires, member(seq))  -- later than before: wake stays a bound
return {op, now, 'ok', num(jk, 'att'), expires}
"""

# ARGV[3..]: job id, token. Back in its old place in line, the attempt refunded.
RELEASE = r"""
local jk, seq = live(ARGV[3], ARGV[4])
if not jk then return seq end
redis.call('ZREM', K_LEASES, member(seq))
redis.call('HINCRBY', jk, 'att', -1)
schedule(jk, seq, num(jk, 'due'))
return {op, now, 'ok'}
"""

# ARGV[3]: job id.
CANCEL = r"""
local jk = P .. 'job:' .. ARGV[3]
local st, seq, due = unpack(redis.call('HMGET', jk, 'st', 'seq', 'due'))
if not st then return {op, now, 'notfound'} end
if st == 'succeeded' or st == 'dead' or st == 'cancelled' then return {op, now, 'false'} end
seq = tonumber(seq)
if st == 'leased' then redis.call('ZREM', K_LEASES, member(seq))
elseif st == 'ready' then redis.call('ZREM', K_READY, ready_member(tonumber(due), seq))
else redis.call('ZREM', K_DELAYED, member(seq)) end
finish(jk, seq, 'cancelled', now)
return {op, now, 'true'}
"""

# ARGV[3..]: job id, max_pending ('' = unbounded). Attempts zeroed; the token keeps growing.
REDRIVE = r"""
local jk = P .. 'job:' .. ARGV[3]
local st, seq = unpack(redis.call('HMGET', jk, 'st', 'seq'))
if not st then return {op, now, 'notfound'} end
if st ~= 'dead' then return {op, now, 'false'} end
if ARGV[4] ~= '' and pending() >= tonumber(ARGV[4]) then return {op, now, 'full'} end
seq = tonumber(seq)
redis.call('ZREM', K_DEAD, member(seq))
redis.call('ZREM', K_FORGET, member(seq))
redis.call('PERSIST', jk)
redis.call('HSET', jk, 'att', 0)
redis.call('HDEL', jk, 'prev', 'fin')
schedule(jk, seq, now)
return {op, now, 'true'}
"""

# ARGV[3]: job id. Reads settle too: every public call applies what is due first.
GET = r"""
local fields = redis.call('HGETALL', P .. 'job:' .. ARGV[3])
if #fields == 0 then return {op, now, 'notfound'} end
return {op, now, 'ok', fields}
"""

# ARGV[3..]: job id, token.
IS_CURRENT = r"""
local jk, seq = live(ARGV[3], ARGV[4])
if not jk then return seq end
return {op, now, 'ok'}
"""

NEXT_DUE = r"""
if redis.call('ZCARD', K_READY) > 0 then return {op, now, 'ok', now} end
local best = nil
for _, k in ipairs({K_DELAYED, K_LEASES}) do
  local first = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
  if #first > 0 and (best == nil or tonumber(first[2]) < best) then best = tonumber(first[2]) end
end
if best == nil then return {op, now, 'none'} end
return {op, now, 'ok', best}
"""

DEAD_LETTERS = r"""
local out = {}
for _, m in ipairs(redis.call('ZRANGE', K_DEAD, 0, -1)) do
  local fields = redis.call('HGETALL', job_key(tonumber(m)))
  if #fields > 0 then
    out[#out + 1] = fields
  else  -- past its retention: Redis expired the hash before a settle step reached it
    redis.call('ZREM', K_DEAD, m)
  end
end
return {op, now, 'ok', out}
"""

STATISTICS = r"""
redis.call('ZREMRANGEBYSCORE', K_IDEMX, '-inf', now)
return {op, now, 'ok', redis.call('ZCARD', K_DELAYED), redis.call('ZCARD', K_READY),
        redis.call('ZCARD', K_LEASES), redis.call('SCARD', K_SUCCEEDED),
        redis.call('ZCARD', K_DEAD), redis.call('SCARD', K_CANCELLED),
        redis.call('ZCARD', K_IDEMX)}
"""

# The reaper: settling is all it does. Returns how many leases it expired.
REAP = r"""
return {op, now, 'ok', expired_now}
"""

# ARGV[3..]: job id, token, effect JSON. The fence is checked where the effect lands, in
# the same atomic step: a zombie's effect is refused, a re-run finds it committed.
COMMIT = r"""
local jk, seq = live(ARGV[3], ARGV[4])
if not jk then return seq end
if redis.call('HSETNX', jk, 'eff', ARGV[5]) == 0 then return {op, now, 'false'} end
return {op, now, 'true'}
"""

# Every committed effect of a job the queue still holds: {id, effect, id, effect, ...}.
EFFECTS = r"""
local out = {}
local function collect(seq)
  local e = redis.call('HGET', job_key(seq), 'eff')
  if e then out[#out + 1] = job_id(seq); out[#out + 1] = e end
end
for _, k in ipairs({K_READY, K_DELAYED, K_LEASES, K_DEAD}) do
  for _, m in ipairs(redis.call('ZRANGE', k, 0, -1)) do collect(tonumber(string.sub(m, -12))) end
end
for _, k in ipairs({K_SUCCEEDED, K_CANCELLED}) do
  for _, m in ipairs(redis.call('SMEMBERS', k)) do collect(tonumber(m)) end
end
return {op, now, 'ok', out}
"""

SCRIPTS = {
    name: PRELUDE + body
    for name, body in {
        "enqueue": ENQUEUE,
        "claim": CLAIM,
        "ack": ACK,
        "nack": NACK,
        "heartbeat": HEARTBEAT,
        "release": RELEASE,
        "cancel": CANCEL,
        "redrive": REDRIVE,
        "get": GET,
        "is_current": IS_CURRENT,
        "next_due": NEXT_DUE,
        "dead_letters": DEAD_LETTERS,
        "statistics": STATISTICS,
        "reap": REAP,
        "commit": COMMIT,
        "effects": EFFECTS,
    }.items()
}
