-- Shared by every engine script (prepended to each at load time).
-- KEYS: the state of one engine; all share the hash tag {engine_id} so a script stays in one
-- Redis Cluster slot. Per-block data are Redis hashes keyed by the 16-byte block hash.
local K = {
  meta = KEYS[1],    -- epoch, nonce, model, block_size, num_blocks, lease_ms, pin_budget,
                     -- history_cap, seq (last applied) + its request digest and reply, counters
  bid = KEYS[2],     -- hash -> block id
  own = KEYS[3],     -- block id -> hash (a block id maps to at most one live hash)
  ref = KEYS[4],     -- hash -> refcount
  par = KEYS[5],     -- hash -> parent hash ('' for the first block of a chain)
  kids = KEYS[6],    -- hash -> number of held children (absent = 0)
  last = KEYS[7],    -- hash -> logical time of last use (acquire, commit, release)
  pin = KEYS[8],     -- held hash -> 'e' (an explicit pin covers it) or 'a' (automatic, hot)
  pinexp = KEYS[9],  -- zset: the names of explicit pins with a TTL, score = expiry (ms)
  -- Hit history, kept past a block's eviction (and across Register): hash ->
  -- 'window_start_ms uses_this_window uses_previous_window'; admissions count the uses.
  hot = KEYS[10],
  free = KEYS[11],   -- zset: refcount 0 and not pinned, score = last use
  lru = KEYS[12],    -- zset: the eviction candidates = free and no held children
  hage = KEYS[13],   -- zset: the history's hashes by last use (a history tick): trim order
  pinchg = KEYS[14], -- hash -> pin state now ('e', 'a', '-'): changes the next Apply reports
  vref = KEYS[15],   -- hash -> when (ms) its entry in Lookup's view was last written
  -- Explicit pins, whole: a pin is named by the last hash of the chain it was asked for and
  -- covers the held prefix of that chain at its last pinning (16-byte hashes, root first).
  -- A block is pinned while any pin covers it; each pin has its own expiry (pinexp).
  pins = KEYS[16],   -- pin name -> the hashes it covers, concatenated
  cover = KEYS[17],  -- hash -> how many pins cover it (absent = 0); kept while a covered
                     -- block is dropped, so the pin holds it again if it is committed again
}
local ALL_KEYS = {K.meta, K.bid, K.own, K.ref, K.par, K.kids, K.last, K.pin, K.pinexp,
                  K.hot, K.free, K.lru, K.hage, K.pinchg, K.vref, K.pins, K.cover}
-- What Register drops: the blocks and their pins; not the hit history (hot, hage).
local BLOCK_KEYS = {K.meta, K.bid, K.own, K.ref, K.par, K.kids, K.last, K.pin, K.pinexp,
                    K.free, K.lru, K.pinchg, K.vref, K.pins, K.cover}
local HASH_BYTES = 16

-- Redis turns Lua numbers into strings with %.14g; epochs and times need every digit.
local function fmt(x)
  return string.format('%.0f', x)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0')
end

-- A strictly increasing per-engine clock: LRU order is exact and ties never happen.
local function tick()
  return redis.call('HINCRBY', K.meta, 'clock', 1)
end

-- Fatal errors abort the whole script before any write; Python maps the prefix to a status.
local function fail(code, message)
  return redis.error_reply(code .. ' ' .. message)
end

-- How this version keeps explicit pins (whole: pins, cover), written by Register. A
-- registration made by an older index (one pin flag and one expiry per block, no records)
-- would be misread, its pins never unpinned nor lapsing: it must register again, which drops
-- that state and re-states the engine's pins whole.
local PIN_LAYOUT = 'whole'

local function check_epoch(epoch)
  local current, layout = unpack(redis.call('HMGET', K.meta, 'epoch', 'pin_layout'))
  if not current then
    return fail('NOT_FOUND', 'engine is not registered or its lease expired; register again')
  end
  if layout ~= PIN_LAYOUT then
    return fail('NOT_FOUND', 'engine was registered by an older index version, whose pins ' ..
      'this one cannot read; register again')
  end
  if current ~= epoch then
    -- Epochs only rise: one above the current was never issued by this Redis, or the Redis
    -- lost the registration that issued it (a failover or restore), not re-registered over.
    if tonumber(epoch) > tonumber(current) then
      return fail('STALE_EPOCH', 'epoch ' .. epoch .. ' is newer than the current epoch ' ..
        current .. ': Register never returned it here, or Redis lost that registration ' ..
        '(a failover or restore); register again')
    end
    return fail('STALE_EPOCH', 'epoch ' .. epoch .. ' is stale; the current epoch is ' ..
      current .. ' (the engine re-registered); register again')
  end
  return nil
end

-- Recompute free/lru membership from refcount, pin and children: one place owns the invariant
-- "lru = refcount 0, not pinned, no held children".
local function settle(h)
  if h == '' or redis.call('HEXISTS', K.bid, h) == 0 then
    return
  end
  if num(K.ref, h) == 0 and redis.call('HEXISTS', K.pin, h) == 0 then
    local last = redis.call('HGET', K.last, h)
    redis.call('ZADD', K.free, last, h)
    if num(K.kids, h) == 0 then
      redis.call('ZADD', K.lru, last, h)
    else
      redis.call('ZREM', K.lru, h)
    end
  else
    redis.call('ZREM', K.free, h)
    redis.call('ZREM', K.lru, h)
  end
end

-- Every pin state change goes through these two, so the next Apply can report it.
local function set_pin(h, kind)
  if redis.call('HGET', K.pin, h) ~= kind then
    redis.call('HSET', K.pin, h, kind)
    redis.call('HSET', K.pinchg, h, kind)
  end
end

local function unpin(h)
  if redis.call('HDEL', K.pin, h) == 1 then
    redis.call('HSET', K.pinchg, h, '-')
  end
  settle(h)
end

local function split_hashes(packed)
  local hashes = {}
  for i = 1, #packed, HASH_BYTES do
    hashes[#hashes + 1] = string.sub(packed, i, i + HASH_BYTES - 1)
  end
  return hashes
end

-- One more pin covers each of `hashes`: a held one is pinned explicitly (an automatic pin
-- becomes explicit). Returns how many of them no pin covered before.
local function cover_add(hashes)
  local added = 0
  for _, h in ipairs(hashes) do
    if redis.call('HINCRBY', K.cover, h, 1) == 1 then added = added + 1 end
    if redis.call('HEXISTS', K.bid, h) == 1 then
      set_pin(h, 'e')
      settle(h)
    end
  end
  return added
end

-- One pin fewer covers each of `hashes`; the held ones no pin covers now are unpinned, leaf
-- first. Returns how many blocks that unpinned.
local function cover_remove(hashes)
  local unpinned = 0
  for i = #hashes, 1, -1 do
    local h = hashes[i]
    if redis.call('HINCRBY', K.cover, h, -1) <= 0 then
      redis.call('HDEL', K.cover, h)
      if redis.call('HGET', K.pin, h) == 'e' then
        unpin(h)
        unpinned = unpinned + 1
      end
    end
  end
  return unpinned
end

-- Drops the pin `name` (nothing if there is none); how many blocks that unpinned.
local function drop_pin(name)
  local packed = redis.call('HGET', K.pins, name)
  redis.call('ZREM', K.pinexp, name)  -- (an expiry without a record: never read again)
  if not packed then return 0 end
  redis.call('HDEL', K.pins, name)
  return cover_remove(split_hashes(packed))
end

-- The pins whose time has come, and only those (no scan of the others).
local function expire_pins(now)
  local due = redis.call('ZRANGEBYSCORE', K.pinexp, '-inf', fmt(now))
  for _, name in ipairs(due) do
    drop_pin(name)
  end
end

-- Sliding-window hit estimate: the previous window's hits weighted by how much of it still
-- overlaps the window ending now, plus this window's hits. Windows start at a block's first hit.
-- State is one packed field per block; this takes and returns it (nil = never hit), so callers
-- can read and write many blocks in one call each.
local function hot_update(packed, now, window_ms, add)
  local w0, cur, prev
  if not packed then
    if add == 0 then
      return 0, nil
    end
    w0, cur, prev = now, 0, 0
  else
    local a, b, c = string.match(packed, '(%d+) (%d+) (%d+)')
    w0, cur, prev = tonumber(a), tonumber(b), tonumber(c)
    local passed = math.floor((now - w0) / window_ms)
    if passed >= 1 then
      if passed == 1 then prev = cur else prev = 0 end
      cur = 0
      w0 = w0 + passed * window_ms
    end
  end
  cur = cur + add
  return prev * (1 - (now - w0) / window_ms) + cur, fmt(w0) .. ' ' .. cur .. ' ' .. prev
end

-- unpack() is bounded by Lua's C stack: long argument lists go in slices.
local SLICE = 2000

local function call_sliced(cmd, key, args)
  for i = 1, #args, SLICE do
    redis.call(cmd, key, unpack(args, i, math.min(i + SLICE - 1, #args)))
  end
end

local function hmget(key, fields)
  local values = {}
  for i = 1, #fields, SLICE do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + SLICE - 1, #fields)))
    for j = 1, #part do
      values[i + j - 1] = part[j]
    end
  end
  return values
end

local function pin_budget()
  return num(K.meta, 'pin_budget')
end

local function refresh_ttl(ttl_ms)
  for _, key in ipairs(ALL_KEYS) do
    redis.call('PEXPIRE', key, fmt(ttl_ms))
  end
end
