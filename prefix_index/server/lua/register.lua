-- ARGV: model_identity, block_size, num_blocks, lease_ms, pin_budget, nonce, history_cap,
-- serving_address, engine_id, instance_id, replaces
-- Returns {epoch}, or {0, lease_remaining_ms, holder_address, holder_instance_id} when another
-- process (a different, non-empty nonce) holds a live lease on this engine id: then nothing
-- changes. `replaces` (non-empty) takes the lease over from a holder registered under that
-- instance id, which the caller found gone; a holder that changed since is refused as above.
-- Otherwise drops the engine's blocks and pins (not its hit history) and returns a new epoch:
-- max(old + 1, now in microseconds), so epochs keep rising even when Redis lost its data,
-- and publishes the reset (the engine holds nothing at this epoch) on the residency channel.
local nonce = ARGV[6]
local holder = redis.call('HGET', K.meta, 'nonce')
if holder and holder ~= '' and holder ~= nonce then
  local instance = redis.call('HGET', K.meta, 'instance') or ''
  if ARGV[11] == '' or instance == '' or instance ~= ARGV[11] then
    return {0, redis.call('PTTL', K.meta), redis.call('HGET', K.meta, 'address') or '', instance}
  end
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local old = tonumber(redis.call('HGET', K.meta, 'epoch') or '0')
local epoch = math.max(old + 1, now_us)
-- The history's trim order continues where it was.
local hclock = num(K.meta, 'hclock')
redis.call('DEL', unpack(BLOCK_KEYS))
redis.call('HSET', K.meta, 'epoch', fmt(epoch), 'nonce', nonce, 'model', ARGV[1],
  'block_size', ARGV[2], 'num_blocks', ARGV[3], 'lease_ms', ARGV[4], 'pin_budget', ARGV[5],
  'history_cap', ARGV[7], 'address', ARGV[8], 'instance', ARGV[10], 'clock', 0, 'hclock', fmt(hclock), 'seq', 0,
  'pin_layout', PIN_LAYOUT,
  'queries', 0, 'hits', 0, 'evictions', 0, 'forgets', 0)
-- A smaller pool than before: trim the kept history to the new cap at once.
local over = redis.call('ZCARD', K.hage) - tonumber(ARGV[7])
if over > 0 then
  local gone = redis.call('ZPOPMIN', K.hage, over)
  local names = {}
  for i = 1, #gone, 2 do names[#names + 1] = gone[i] end
  call_sliced('HDEL', K.hot, names)
end
refresh_ttl(tonumber(ARGV[4]))
redis.call('PUBLISH', RESIDENCY_CHANNEL, cmsgpack.pack({'R', ARGV[9], fmt(epoch), ARGV[1], {}}))
return {fmt(epoch)}
