"""The Lua behind stage 3: one script per transition, each one EVALSHA (one round trip).

Stage 1's rules, restated on Redis. Every script starts the same way (``PRELUDE``):

1. ``now`` from the server's ``TIME``, in integer µs (about 1.7·10¹⁵, exact in a Lua
   double below 2^53). No client clock is ever read: workers' clocks disagree.
2. ``op``, the queue's operation counter, incremented. Redis runs scripts one at a time,
   so ``op`` is the order the transitions happened in; every reply carries ``op`` and
   ``now``, and the suite replays a run through an exact model in that order.
3. ``settle(now)``: what time made due, in stage 1's order — lease expiries in
   ``(expires_at, seq)`` order (each costs the attempt its claim counted, and its
   backoff runs from the expiry), then delayed jobs whose time has come, then retention
   of finished jobs. Each step is bounded (``LIMIT``), so one call never blocks the
   server for long; what is left is settled by the next call. The reaper is this
   prelude and nothing else.

Keys. A queue is a fixed set of keys, :data:`KEYS`, all ``<key_prefix>{<name>}:<key>``,
and every script declares all of them (``KEYS[1..13]``) and touches no other. The hash
tag puts them in one Redis Cluster slot; declaring them is what lets a cluster route a
script, and refuse it while the slot moves (see ``moving``). So there is no key per job
or per idempotency record: a job is a few fields of a hash, named by its seq.
``ARGV[1]`` is the queue's settings, encoded once as one string; ``ARGV[2]`` the
client's seed for the queue's generator (below). Each argument costs the client an
encode and the server a parse, on every call.

- ``meta``: hash of counters — ``seq`` (jobs enqueued), ``ops``, ``gen`` (the store's
  generation: the server's µs when it was created; job ids carry it,
  ``job-7@1764640000123456``, so a store lost and started again never reissues one),
  ``wake`` (below), ``rng`` (the generator's state), ``deaths`` (the order of death).
- ``ready``: sorted set, score ``-priority``, member ``"<due µs, 16 digits>:<seq, 12
  digits>"``. Equal scores sort by member, byte by byte, so ``ZPOPMIN`` pops the highest
  priority, then the earliest due, then the oldest — the payload is never compared.
- ``delayed``: score due µs, member ``<seq, 12 digits>``; ``leases``: score expiry µs,
  same members, so equal expiries come out by seq.
- ``jobs``: the pending jobs' records, ``done``: the finished jobs' — fields
  ``"<seq>:<attr>"``: ``p`` payload (JSON), ``pr`` priority, ``due``, ``att`` attempts,
  ``tok`` fencing token, ``st`` state, ``max`` max_attempts, ``enq``, ``exp``/``wid``
  (while leased), ``fin`` (while finished), ``err``, ``res`` (JSON), ``prev``
  (decorrelated jitter's previous delay), ``eff`` (the committed effect, JSON: keyed by
  job, never by (job, token), and forgotten with the job). A job's record moves to
  ``done`` when it finishes and back when it is redriven.
- ``forget``: every finished job, scored by when it finished (retention trims it);
  ``succeeded``/``cancelled``: sets; ``dead``: sorted by the order of death.
- ``idem``: hash, idempotency key -> ``"<job id> <expiry µs>"``; ``idemx``: the same
  keys by expiry, to drop the expired ones and count the live ones.
- ``moving``: a key no script ever writes. While a slot moves, a node runs a
  multi-key command only if it holds every key the command names, so this one keeps
  every script off both nodes (``TRYAGAIN``: an outage) until the move is over. Without
  it a script would run on the node the slot is leaving whenever that node still held
  every other key — and there a command on a key the node no longer holds (one this
  very script just emptied, as ``ZPOPMIN`` does the last ready job) fails the script
  halfway, with its earlier writes kept.

Retention without a key per job: a TTL on whatever holds history. The script that
finishes a job sets ``done``, ``forget`` and the job's index to expire at now +
retention — every member finished at or before now, so then all of them are past it —
and the one that records an idempotency key sets ``idem`` and ``idemx`` to expire with
that newest record. ``settle`` forgets each job at its own instant, and the reads treat
a finished job past its retention as gone even before a bounded settle reaches it. So
an idle queue shrinks to ``meta`` and its live jobs' keys with no call to settle it.
Pending jobs have no TTL — they are the queue.

Cost. A script is cheap next to its round trip only if it does little: a call with
nothing due must not scan. ``wake`` holds a lower bound on the earliest time anything
becomes due (a lease expiry, a delayed job, a retention deadline); every script that
adds such a time lowers it, and ``settle`` runs only once ``now`` reaches it, then
recomputes it. Fields that only mean something in one state (``exp``/``wid`` while
leased) are left behind on leaving it rather than deleted: the reader ignores them.

Jitter needs randomness the server can reproduce: a Park–Miller generator (exact in
doubles) whose state the queue keeps in ``meta``. It is seeded from the injected ``rng``
of the client whose call draws first (each client draws its seed once, when built), and
only a backoff advances it — so, as in stage 1, a read or a refused call draws nothing,
and a run's delays depend on its retries alone.
"""

from __future__ import annotations

#: Every key of a queue, in the order each script declares them (``<prefix>{<name>}:<key>``).
KEYS = (
    "meta", "ready", "delayed", "leases", "jobs", "done", "forget", "succeeded",
    "cancelled", "dead", "idem", "idemx", "moving",
)  # fmt: skip

#: ARGV[1] (settings) and ARGV[2] (seed) come first; a script's own arguments follow.
COMMON_ARGS = 2

PRELUDE = r"""
local unpack = unpack or table.unpack
local K_META, K_READY, K_DELAYED, K_LEASES, K_JOBS, K_DONE, K_FORGET, K_SUCCEEDED,
      K_CANCELLED, K_DEAD, K_IDEM, K_IDEMX = unpack(KEYS)  -- KEYS[13]: the fence, unused
local LEASE, MAX_ATT, BASE, CAP, JITTER, RETENTION, DEDUP =
  string.match(ARGV[1], '^(%d+) (%d+) (%d+) (%d+) (%a+) (%d+) (%d+)$')
LEASE, MAX_ATT, BASE, CAP = tonumber(LEASE), tonumber(MAX_ATT), tonumber(BASE), tonumber(CAP)
RETENTION, DEDUP = tonumber(RETENTION), tonumber(DEDUP)
local LIMIT = 1000  -- the most of each kind one call settles
local NEVER = 9000000000000000  -- µs, in the year 2255: "nothing is due, ever"

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local op = redis.call('HINCRBY', K_META, 'ops', 1)
local wake, GEN = unpack(redis.call('HMGET', K_META, 'wake', 'gen'))
wake = tonumber(wake or 0)  -- missing (new, or lost): settle
GEN = GEN or ''  -- the store's generation (see job_id)

local function int(x) return string.format('%d', x) end
local function pad(x, w) return string.format('%0' .. w .. 'd', x) end
local function member(seq) return pad(seq, 12) end
local function ready_member(due, seq) return pad(due, 16) .. ':' .. pad(seq, 12) end
-- A job's id carries the store's generation: the server's time (µs) when the store was
-- created. A store that was lost (a restart without persistence) starts again at job 1,
-- but under a new generation, so a zombie's lease on an old job-7 never fence-checks
-- against the new one: its id names no job any more.
local function job_id(seq) return 'job-' .. int(seq) .. '@' .. GEN end

-- A job's record: the fields '<seq>:<attr>' of K_JOBS while it is pending, of K_DONE
-- once it is finished. Writes go to K_JOBS: a finished job changes only by moving.
local ATTRS = {'p', 'pr', 'due', 'att', 'tok', 'st', 'max', 'enq', 'exp', 'wid', 'fin',
               'err', 'res', 'prev', 'eff'}
local function field(seq, attr) return int(seq) .. ':' .. attr end
local function fields(seq)
  local out = {}
  for i, attr in ipairs(ATTRS) do out[i] = field(seq, attr) end
  return out
end
local function num(seq, attr) return tonumber(redis.call('HGET', K_JOBS, field(seq, attr))) end
local function set(seq, ...)  -- attr, value, attr, value, …
  local kv = {...}
  for i = 1, #kv, 2 do kv[i] = field(seq, kv[i]) end
  redis.call('HSET', K_JOBS, unpack(kv))
end
-- The job as {attr, value, …, 'id', id, 'seq', seq}, from hash h.
local function snapshot(h, seq)
  local values = redis.call('HMGET', h, unpack(fields(seq)))
  local out = {'id', job_id(seq), 'seq', int(seq)}
  for i, attr in ipairs(ATTRS) do
    if values[i] then out[#out + 1] = attr; out[#out + 1] = values[i] end
  end
  return out
end
local function move(from, to, seq)
  local names = fields(seq)
  local values = redis.call('HMGET', from, unpack(names))
  local kv = {}
  for i, name in ipairs(names) do
    if values[i] then kv[#kv + 1] = name; kv[#kv + 1] = values[i] end
  end
  redis.call('HSET', to, unpack(kv))
  redis.call('HDEL', from, unpack(names))
end

-- Park–Miller (minimal standard): products stay below 2^47, exact in doubles. Its state
-- lives in the store, read on the first draw and written back after each one.
local seed = nil
local function rnd31()
  seed = seed or tonumber(redis.call('HGET', K_META, 'rng') or ARGV[2])
  seed = (seed * 48271) % 2147483647
  redis.call('HSET', K_META, 'rng', int(seed))
  return seed
end
local function randrange(lo, hi)  -- an integer in [lo, hi)
  local n = hi - lo
  if n <= 1 then return lo end
  local r = (rnd31() % 4194304) * 2147483648 + rnd31()  -- 53 random bits at most
  return lo + math.fmod(r, n)
end

local function backoff(seq, attempt)
  if JITTER == 'decorrelated' then
    local prev = num(seq, 'prev') or BASE
    local d = math.min(CAP, randrange(BASE, 3 * prev + 1))
    set(seq, 'prev', int(d))
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
    redis.call('HSET', K_META, 'wake', int(at))
  end
end

local function make_ready(seq, due)
  set(seq, 'st', 'ready')
  redis.call('ZADD', K_READY, -num(seq, 'pr'), ready_member(due, seq))
end

-- Wait for `due`: READY at once if due, else SCHEDULED in the delayed set.
local function schedule(seq, due)
  if due <= now then
    set(seq, 'due', int(due))
    make_ready(seq, due)
  else
    set(seq, 'due', int(due), 'st', 'scheduled')
    redis.call('ZADD', K_DELAYED, due, member(seq))
    due_at(due)
  end
end

local function expire_at(k, us) redis.call('PEXPIREAT', k, int(math.ceil(us / 1000))) end

local function finish(seq, state, at)
  set(seq, 'st', state, 'fin', int(at))
  move(K_JOBS, K_DONE, seq)
  redis.call('ZADD', K_FORGET, at, member(seq))
  due_at(at + RETENTION)
  local index = K_CANCELLED
  if state == 'dead' then
    index = K_DEAD
    redis.call('ZADD', K_DEAD, redis.call('HINCRBY', K_META, 'deaths', 1), member(seq))
  elseif state == 'succeeded' then index = K_SUCCEEDED; redis.call('SADD', index, member(seq))
  else redis.call('SADD', index, member(seq)) end
  -- Every member of these finished at or before now, so at now + RETENTION all of them
  -- are past their retention: they go then as a whole, and a queue left idle shrinks to
  -- its live jobs with no call to settle it. Until then settle forgets each at its time.
  for _, k in ipairs({K_DONE, K_FORGET, index}) do expire_at(k, now + RETENTION) end
end

-- A leased attempt failed at `at`: retry after backoff, or die after max_attempts.
local function fail(seq, err, at)
  set(seq, 'err', err)
  local attempts = num(seq, 'att')
  if attempts >= num(seq, 'max') then finish(seq, 'dead', at)
  else schedule(seq, at + backoff(seq, attempts)) end
end

local function settle()
  local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'WITHSCORES',
                             'LIMIT', 0, LIMIT)
  for i = 1, #expired, 2 do
    redis.call('ZREM', K_LEASES, expired[i])
    fail(tonumber(expired[i]), 'lease expired', tonumber(expired[i + 1]))
  end
  local due = redis.call('ZRANGEBYSCORE', K_DELAYED, '-inf', now, 'LIMIT', 0, LIMIT)
  for i = 1, #due do
    local seq = tonumber(due[i])
    redis.call('ZREM', K_DELAYED, due[i])
    make_ready(seq, num(seq, 'due'))
  end
  local old = redis.call('ZRANGEBYSCORE', K_FORGET, '-inf', now - RETENTION, 'LIMIT', 0, LIMIT)
  for i = 1, #old do
    redis.call('ZREM', K_FORGET, old[i])
    redis.call('SREM', K_SUCCEEDED, old[i])
    redis.call('SREM', K_CANCELLED, old[i])
    redis.call('ZREM', K_DEAD, old[i])
    redis.call('HDEL', K_DONE, unpack(fields(tonumber(old[i]))))
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
  redis.call('HSET', K_META, 'wake', int(wake))
  return #expired / 2
end

local expired_now = 0
if now >= wake then expired_now = settle() end  -- else nothing can be due: no scans

local function pending()
  return redis.call('ZCARD', K_READY) + redis.call('ZCARD', K_DELAYED)
         + redis.call('ZCARD', K_LEASES)
end

-- The job `id` names, if the queue holds it: its seq, its state and the hash its record
-- is in (K_JOBS: pending, K_DONE: finished); nil for an id of no job of this store, and
-- for a finished job past its retention that a bounded settle has not reached yet.
local function find(id)
  local digits = string.match(id, '^job%-(%d+)@')
  if not digits or #digits > 15 then return nil end
  local seq = tonumber(digits)
  if job_id(seq) ~= id then return nil end  -- another generation's id, or not one at all
  local st = redis.call('HGET', K_JOBS, field(seq, 'st'))
  if st then return seq, st, K_JOBS end
  local fin
  st, fin = unpack(redis.call('HMGET', K_DONE, field(seq, 'st'), field(seq, 'fin')))
  if st and tonumber(fin) + RETENTION > now then return seq, st, K_DONE end
  return nil
end

-- The job a lease names, if that lease is live: its seq, or nil and an error reply. A
-- lease past its expiry that a bounded settle has not reached yet is not live either.
local function live(id, token)
  local seq, st, h = find(id)
  if not seq then return nil, {op, now, 'notfound'} end
  local tok, exp = unpack(redis.call('HMGET', h, field(seq, 'tok'), field(seq, 'exp')))
  tok = tonumber(tok)
  if st ~= 'leased' or tok ~= tonumber(token) or tonumber(exp) <= now then
    return nil, {op, now, 'stale', st, tok}
  end
  return seq
end
"""

# ARGV[3..]: payload JSON, priority, due µs ('' = now), delay µs ('' = none),
# idempotency key ('' = none), max_pending ('' = unbounded).
ENQUEUE = r"""
local payload, priority, run_at, delay = ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local ikey, max_pending = ARGV[7], ARGV[8]
if ikey ~= '' then
  local known = redis.call('HGET', K_IDEM, ikey)
  if known then
    local id, expiry = string.match(known, '(%S+) (%d+)')
    if tonumber(expiry) > now then return {op, now, 'dup', id} end
  end
end
if max_pending ~= '' and pending() >= tonumber(max_pending) then return {op, now, 'full'} end
if GEN == '' then GEN = int(now); redis.call('HSET', K_META, 'gen', GEN) end  -- a new store
local seq = redis.call('HINCRBY', K_META, 'seq', 1)
local id = job_id(seq)
local due = now
if run_at ~= '' then due = tonumber(run_at) elseif delay ~= '' then due = now + tonumber(delay) end
set(seq, 'p', payload, 'pr', int(priority), 'att', 0, 'tok', 0, 'max', int(MAX_ATT),
    'enq', int(now))
schedule(seq, due)
if ikey ~= '' and DEDUP > 0 then
  -- Records past their expiry go as one is added (a bounded number a call); the hash and
  -- its index go as a whole with the newest one. A record's expiry is counted from the
  -- first enqueue only, and kept in its value: a record past it is dead before it is gone.
  local old = redis.call('ZRANGEBYSCORE', K_IDEMX, '-inf', now, 'LIMIT', 0, LIMIT)
  if #old > 0 then
    redis.call('HDEL', K_IDEM, unpack(old))
    redis.call('ZREM', K_IDEMX, unpack(old))
  end
  local expiry = now + DEDUP
  redis.call('HSET', K_IDEM, ikey, id .. ' ' .. int(expiry))
  redis.call('ZADD', K_IDEMX, expiry, ikey)
  expire_at(K_IDEM, expiry)
  expire_at(K_IDEMX, expiry)
end
return {op, now, 'ok', id}
"""

# ARGV[3]: worker id.
CLAIM = r"""
local top = redis.call('ZPOPMIN', K_READY)
if #top == 0 then return {op, now, 'none'} end
local seq = tonumber(string.sub(top[1], 18))
local expires = now + LEASE
local attempt, token = num(seq, 'att') + 1, num(seq, 'tok') + 1  -- the token never resets
set(seq, 'st', 'leased', 'att', attempt, 'tok', token, 'exp', int(expires), 'wid', ARGV[3])
redis.call('ZADD', K_LEASES, expires, member(seq))
due_at(expires)
return {op, now, 'ok', job_id(seq), token, attempt, expires}
"""

# ARGV[3..]: job id, token, result JSON.
ACK = r"""
local seq, refused = live(ARGV[3], ARGV[4])
if not seq then return refused end
redis.call('ZREM', K_LEASES, member(seq))
set(seq, 'res', ARGV[5])
finish(seq, 'succeeded', now)
return {op, now, 'ok'}
"""

# ARGV[3..]: job id, token, error.
NACK = r"""
local seq, refused = live(ARGV[3], ARGV[4])
if not seq then return refused end
redis.call('ZREM', K_LEASES, member(seq))
fail(seq, ARGV[5], now)
return {op, now, 'ok'}
"""

# ARGV[3..]: job id, token. An expired lease was settled above: it is never revived.
HEARTBEAT = r"""
local seq, refused = live(ARGV[3], ARGV[4])
if not seq then return refused end
local expires = now + LEASE
set(seq, 'exp', int(expires))
redis.call('ZADD', K_LEASES, expires, member(seq))  -- later than before: wake stays a bound
return {op, now, 'ok', num(seq, 'att'), expires}
"""

# ARGV[3..]: job id, token. Back in its old place in line, the attempt refunded.
RELEASE = r"""
local seq, refused = live(ARGV[3], ARGV[4])
if not seq then return refused end
redis.call('ZREM', K_LEASES, member(seq))
set(seq, 'att', num(seq, 'att') - 1)
schedule(seq, num(seq, 'due'))
return {op, now, 'ok'}
"""

# ARGV[3]: job id.
CANCEL = r"""
local seq, st, h = find(ARGV[3])
if not seq then return {op, now, 'notfound'} end
if h == K_DONE then return {op, now, 'false'} end  -- finished already
if st == 'leased' then redis.call('ZREM', K_LEASES, member(seq))
elseif st == 'ready' then redis.call('ZREM', K_READY, ready_member(num(seq, 'due'), seq))
else redis.call('ZREM', K_DELAYED, member(seq)) end
finish(seq, 'cancelled', now)
return {op, now, 'true'}
"""

# ARGV[3..]: job id, max_pending ('' = unbounded). Attempts zeroed; the token keeps growing.
REDRIVE = r"""
local seq, st = find(ARGV[3])
if not seq then return {op, now, 'notfound'} end
if st ~= 'dead' then return {op, now, 'false'} end
if ARGV[4] ~= '' and pending() >= tonumber(ARGV[4]) then return {op, now, 'full'} end
redis.call('ZREM', K_DEAD, member(seq))
redis.call('ZREM', K_FORGET, member(seq))
move(K_DONE, K_JOBS, seq)  -- pending again: out of reach of the finished jobs' TTL
redis.call('HDEL', K_JOBS, field(seq, 'prev'), field(seq, 'fin'))
set(seq, 'att', 0)
schedule(seq, now)
return {op, now, 'true'}
"""

# ARGV[3]: job id. Reads settle too: every public call applies what is due first.
GET = r"""
local seq, _, h = find(ARGV[3])
if not seq then return {op, now, 'notfound'} end
return {op, now, 'ok', snapshot(h, seq)}
"""

# ARGV[3..]: job id, token.
IS_CURRENT = r"""
local seq, refused = live(ARGV[3], ARGV[4])
if not seq then return refused end
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
  local seq = tonumber(m)
  local fin = tonumber(redis.call('HGET', K_DONE, field(seq, 'fin')))
  -- past its retention, and beyond what this call's bounded settle reached: gone
  if fin and fin + RETENTION > now then out[#out + 1] = snapshot(K_DONE, seq) end
end
return {op, now, 'ok', out}
"""

STATISTICS = r"""
local succeeded, dead = redis.call('SCARD', K_SUCCEEDED), redis.call('ZCARD', K_DEAD)
local cancelled = redis.call('SCARD', K_CANCELLED)
-- past their retention, and beyond what this call's bounded settle reached: gone
for _, m in ipairs(redis.call('ZRANGEBYSCORE', K_FORGET, '-inf', now - RETENTION)) do
  succeeded = succeeded - redis.call('SISMEMBER', K_SUCCEEDED, m)
  cancelled = cancelled - redis.call('SISMEMBER', K_CANCELLED, m)
  if redis.call('ZSCORE', K_DEAD, m) then dead = dead - 1 end
end
return {op, now, 'ok', redis.call('ZCARD', K_DELAYED), redis.call('ZCARD', K_READY),
        redis.call('ZCARD', K_LEASES), succeeded, dead, cancelled,
        redis.call('ZCOUNT', K_IDEMX, '(' .. int(now), '+inf')}
"""

# The reaper: settling is all it does. Returns how many leases it expired.
REAP = r"""
return {op, now, 'ok', expired_now}
"""

# ARGV[3..]: job id, token, effect JSON. The fence is checked where the effect lands, in
# the same atomic step: a zombie's effect is refused, a re-run finds it committed.
COMMIT = r"""
local seq, refused = live(ARGV[3], ARGV[4])
if not seq then return refused end
if redis.call('HSETNX', K_JOBS, field(seq, 'eff'), ARGV[5]) == 0 then return {op, now, 'false'} end
return {op, now, 'true'}
"""

# Every committed effect of a job the queue still holds: {id, effect, id, effect, ...}.
EFFECTS = r"""
local out = {}
local function collect(h, seq)
  local e = redis.call('HGET', h, field(seq, 'eff'))
  if e then out[#out + 1] = job_id(seq); out[#out + 1] = e end
end
for _, k in ipairs({K_READY, K_DELAYED, K_LEASES}) do
  for _, m in ipairs(redis.call('ZRANGE', k, 0, -1)) do
    collect(K_JOBS, tonumber(string.sub(m, -12)))
  end
end
-- the finished jobs within their retention (the bound: those a settle has not reached)
for _, m in ipairs(redis.call('ZRANGEBYSCORE', K_FORGET, '(' .. int(now - RETENTION), '+inf')) do
  collect(K_DONE, tonumber(m))
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
