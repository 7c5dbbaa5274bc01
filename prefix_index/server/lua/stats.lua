-- Read-only. Returns {epoch, model, block_size, num_blocks, blocks, evictable, pinned,
-- auto_pinned, pin_budget, queries, hits, evictions, lease_remaining_ms, forgets, history,
-- serving_address},
-- or {} when gone.
local epoch = redis.call('HGET', K.meta, 'epoch')
if not epoch then return {} end
local auto = 0
for _, kind in ipairs(redis.call('HVALS', K.pin)) do
  if kind == 'a' then auto = auto + 1 end
end
return {epoch, redis.call('HGET', K.meta, 'model'), num(K.meta, 'block_size'),
  num(K.meta, 'num_blocks'), redis.call('HLEN', K.bid), redis.call('ZCARD', K.free),
  redis.call('HLEN', K.pin), auto, pin_budget(), num(K.meta, 'queries'), num(K.meta, 'hits'),
  num(K.meta, 'evictions'), redis.call('PTTL', K.meta), num(K.meta, 'forgets'),
  redis.call('HLEN', K.hot), redis.call('HGET', K.meta, 'address') or ''}
