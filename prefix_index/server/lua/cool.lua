-- ARGV: hot_threshold (0 = automatic pinning off), window_ms, cool_fraction. Returns -1 when
-- the engine is gone (its lease expired), else the number of blocks unpinned.
-- Unpins automatic pins whose use estimate fell below threshold * cool_fraction (hysteresis:
-- a block at the threshold does not flap), drops explicit pins whose TTL passed, and drops
-- history entries that decayed to nothing (oldest first). Keeps the lease as it is.
if redis.call('EXISTS', K.meta) == 0 then return -1 end
local threshold, window_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local floor = threshold * tonumber(ARGV[3])
local now = now_ms()
expire_pins(now)
local cooled = 0
if threshold > 0 then
  local pins = redis.call('HGETALL', K.pin)
  for i = 1, #pins, 2 do
    local h = pins[i]
    if pins[i + 1] == 'a' then
      local estimate, packed = hot_update(redis.call('HGET', K.hot, h), now, window_ms, 0)
      if packed then redis.call('HSET', K.hot, h, packed) end
      if estimate < floor then
        unpin(h)
        cooled = cooled + 1
      end
    end
  end
end
-- Entries are used in tick order, so the oldest ones decay first; stop at a live one.
local oldest = redis.call('ZRANGE', K.hage, 0, 255)
for _, h in ipairs(oldest) do
  local estimate = hot_update(redis.call('HGET', K.hot, h), now, window_ms, 0)
  if estimate > 0 then break end
  redis.call('HDEL', K.hot, h)
  redis.call('ZREM', K.hage, h)
end
local ttl = redis.call('PTTL', K.meta)
if ttl > 0 then refresh_ttl(ttl) end
return cooled
