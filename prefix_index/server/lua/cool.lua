-- ARGV: hot_threshold, window_ms, cool_fraction. Unpins automatic pins whose hit estimate fell
-- below threshold * cool_fraction (hysteresis: a block at the threshold does not flap), and
-- drops explicit pins whose TTL passed. Keeps the lease as it is. Returns blocks unpinned.
if redis.call('EXISTS', K.meta) == 0 then return 0 end
local threshold, window_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local floor = threshold * tonumber(ARGV[3])
local now = now_ms()
expire_pins(now)
local cooled = 0
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
local ttl = redis.call('PTTL', K.meta)
if ttl > 0 then refresh_ttl(ttl) end
return cooled
