-- Read-only, and on its own (common.lua is not prepended: its KEYS layout is one engine's).
-- KEYS: meta, bid, free of each engine asked, three by three; one engine per call on a Redis
-- Cluster (an engine's keys share a slot, two engines' do not), all of them in one call on a
-- single server: one round trip for the whole Lookup.
-- ARGV: the chain. Returns a row per engine, in KEYS' order: {epoch, model, num_blocks, held,
-- evictable, matched}, or an empty table when the engine is gone.
local rows = {}
for e = 1, #KEYS, 3 do
  local meta, bid, free = KEYS[e], KEYS[e + 1], KEYS[e + 2]
  local epoch = redis.call('HGET', meta, 'epoch')
  if not epoch then
    rows[#rows + 1] = {}
  else
    local matched = 0
    for _, h in ipairs(ARGV) do
      if redis.call('HEXISTS', bid, h) == 0 then break end
      matched = matched + 1
    end
    rows[#rows + 1] = {epoch, redis.call('HGET', meta, 'model'),
      tonumber(redis.call('HGET', meta, 'num_blocks') or '0'), redis.call('HLEN', bid),
      redis.call('ZCARD', free), matched}
  end
end
return rows
