"""The Lua behind stage 3: one script per algorithm, one EVALSHA per decision or refund.

Every script reads the time from the server (``TIME``, integer µs) — never from a
client, whose clock may be skewed by seconds — and writes each key it touches with a
``PEXPIRE`` in the same call, so no crash between two calls can leave a key without a
TTL. Shared rules, as in stage 1:

- ``eff = max(TIME, ts)``: stored time never decreases; waits add ``eff - TIME``.
- A denial consumes nothing. It only bumps the key's operation counter ``n``, which
  with the server time orders every decision on a key (the checker replays them): it
  writes back the state it read, time included, so a later step back of the server
  clock finds the key as a peek would have left it.
- State is a string ``"field field …"`` written with ``SET … PX``: value and TTL in
  one command, so no key can ever exist without its TTL.
- ``peek`` (ARGV[4] = "p") and a cost above the limit write nothing.
- A refund (ARGV[4] = "r") is stage 1's: capped at a fresh key's allowance, only the
  current window's units come back, the sliding log gives back its newest units. It
  writes (and bumps ``n``) only a key that exists: a fresh key has nothing to take back.
- The TTL is the time until the key is fresh again, rounded up to whole ms (at least
  1 ms: ``PX 0`` is an error, and a refund may leave a key that is fresh already): once
  a key expires it is indistinguishable from one never seen.

Arithmetic is on Lua 5.1 doubles, exact for integers below 2^53; the limiter keeps
``limit × window_us`` below 2^51 and ``fdiv`` corrects the rounding of ``a / b``.
Numbers go to ``redis.call`` through ``int()``: ``tostring`` would print 1.79e+15.

Every script returns one string, ``"allowed remaining retry_us reset_us n TIME"``
(retry_us -1: never): a flat string costs the client far less to parse than an array.
A refund returns the same string, describing the key after it.
"""

from __future__ import annotations

_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit, window, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local acquire = ARGV[4] == 'a' and cost <= limit
local refund = ARGV[4] == 'r'  -- the client caps a refund's cost at the limit
local function fdiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
  return q
end
local function cdiv(a, b) return -fdiv(-a, b) end
local function int(x) return string.format('%d', x) end
local function px(us) return int(math.max(1, cdiv(us, 1000))) end  -- a TTL in whole ms
local function reply(retry, remaining, reset, n)
  local allowed = 0
  if retry == 0 then allowed = 1 end
  return string.format('%d %d %d %d %d %d', allowed, remaining, retry, reset, n, now)
end
"""

# KEYS[1]: string "tokens ts n", tokens scaled by window: a token is `window` sub-units
# and each µs refills `limit` of them — integers only. A denial writes back the balance
# and time it read (only n moves): brought forward to eff, a step back of TIME would
# then refill from the denial's instant. SET … PX writes value and TTL in one command.
TOKEN_BUCKET = (
    _PRELUDE
    + """
local cap = limit * window
local tokens, ts, n = cap, now, 0
local st = redis.call('GET', KEYS[1])
if st then
  local a, b, c = string.match(st, '(%d+) (%d+) (%d+)')
  tokens, ts, n = tonumber(a), tonumber(b), tonumber(c)
end
local eff = math.max(now, ts)
local catch = eff - now
local state = int(tokens) .. ' ' .. int(ts)  -- what a denial writes back
tokens = math.min(cap, tokens + math.min(eff - ts, window) * limit)
local need = cost * window
local retry = 0
if refund then tokens = math.min(cap, tokens + need)  -- never above a full bucket
elseif cost > limit then retry = -1
elseif tokens < need then retry = catch + cdiv(need - tokens, limit)
else tokens = tokens - need end
local reset = catch + cdiv(cap - tokens, limit)
if acquire or (refund and st) then
  n = n + 1
  if retry == 0 then state = int(tokens) .. ' ' .. int(eff) end
  redis.call('SET', KEYS[1], state .. ' ' .. int(n), 'PX', px(reset))
end
return reply(retry, fdiv(tokens, window), reset, n)
"""
)

# KEYS[1]: string "ts n"; KEYS[2]: sorted set, one member per admitted unit, scored by
# its admission time. Members are "<n>.<i>", unique per request and unit: a bare
# timestamp would collapse requests admitted in the same µs into one.
SLIDING_LOG = (
    _PRELUDE
    + """
local ts, n = now, 0
local st = redis.call('GET', KEYS[1])
if st then
  local a, b = string.match(st, '(%d+) (%d+)')
  ts, n = tonumber(a), tonumber(b)
end
local eff = math.max(now, ts)
local inside = '(' .. int(eff - window)  -- the window is (eff - window, eff]
local used = redis.call('ZCOUNT', KEYS[2], inside, '+inf')
local retry = 0
if refund then
  -- the newest units still inside the window go back, as if the request had cost less:
  -- the highest ranks (at most `used` of them, so none of those has left the window)
  local back = math.min(cost, used)
  if back > 0 then redis.call('ZREMRANGEBYRANK', KEYS[2], -back, -1) end
  used = used - back
elseif cost > limit then retry = -1
elseif used + cost > limit then
  -- the (used + cost - limit)-th oldest unit must leave before this request fits
  local e = redis.call('ZRANGEBYSCORE', KEYS[2], inside, '+inf', 'WITHSCORES',
                       'LIMIT', used + cost - limit - 1, 1)
  retry = tonumber(e[2]) + window - now
else used = used + cost end
local reset = eff - now  -- the catch-up: fresh once TIME is back at eff
if used > 0 then
  local newest = eff
  if retry ~= 0 or refund then
    newest = tonumber(redis.call('ZREVRANGEBYSCORE', KEYS[2], '+inf', inside,
                                 'WITHSCORES', 'LIMIT', 0, 1)[2])
  end
  reset = newest + window - now
end
if acquire or (refund and st) then
  n = n + 1
  local ttl = px(reset)
  if acquire and retry == 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', int(eff - window))
    local args = {}
    for i = 1, cost do
      args[#args + 1] = int(eff)
      args[#args + 1] = int(n) .. '.' .. i
      if #args >= 1000 or i == cost then  -- unpack() has a stack limit
        redis.call('ZADD', KEYS[2], unpack(args))
        args = {}
      end
    end
  end
  if retry == 0 then ts = eff; redis.call('PEXPIRE', KEYS[2], ttl) end  -- the log changed
  redis.call('SET', KEYS[1], int(ts) .. ' ' .. int(n), 'PX', ttl)  -- a denial keeps ts
end
return reply(retry, limit - used, reset, n)
"""
)

# KEYS[1]: string "w used ts n" (w: window start); windows are aligned to the server's
# epoch in µs, so every node agrees on where a window starts.
FIXED_WINDOW = (
    _PRELUDE
    + """
local w, used, ts, n = -1, 0, now, 0
local st = redis.call('GET', KEYS[1])
if st then
  local a, b, c, d = string.match(st, '(%d+) (%d+) (%d+) (%d+)')
  w, used, ts, n = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
end
local eff = math.max(now, ts)
local start = fdiv(eff, window) * window
local left = start + window - now  -- until this window ends, catch-up included
if w ~= start then used = 0 end  -- a new window: the old one's units (and refunds) are gone
local retry = 0
if refund then used = used - math.min(cost, used)
elseif cost > limit then retry = -1
elseif used + cost > limit then retry = left
else used = used + cost end
local reset = eff - now  -- the catch-up: fresh once TIME is back at eff
if used > 0 then reset = left end
if acquire or (refund and st) then
  n = n + 1
  if retry == 0 then ts = eff end  -- a denial writes back the time it read
  redis.call('SET', KEYS[1], int(start) .. ' ' .. int(used) .. ' ' .. int(ts) .. ' ' .. int(n),
             'PX', px(reset))
end
return reply(retry, limit - used, reset, n)
"""
)

# Concurrency: KEYS[1] is a sorted set of lease ids scored by expiry (µs). Expired
# leases are dropped before counting, so a crashed holder's slot comes back by itself.
LEASE_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function int(x) return string.format('%d', x) end
local cap, lease, id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', int(now))
local held = redis.call('ZCARD', KEYS[1])
if held >= cap then return {0, held, now} end
redis.call('ZADD', KEYS[1], int(now + lease), id)
local last = tonumber(redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2])
redis.call('PEXPIRE', KEYS[1], int(math.ceil((last - now) / 1000)))
return {1, held + 1, now}
"""

LEASE_RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function int(x) return string.format('%d', x) end
-- expired leases go first: one released at or after its expiry was no longer held
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', int(now))
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
local last = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
if last then
  redis.call('PEXPIRE', KEYS[1], int(math.ceil((tonumber(last) - now) / 1000)))
end
return removed
"""

LEASE_COUNT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now), '+inf')
"""

SCRIPTS = {
    "token_bucket": TOKEN_BUCKET,
    "sliding_log": SLIDING_LOG,
    "fixed_window": FIXED_WINDOW,
}
