-- Read-only. ARGV: the chain. Returns {epoch, model, num_blocks, held, evictable, matched}, or
-- an empty table when the engine is gone.
local epoch = redis.call('HGET', K.meta, 'epoch')
if not epoch then return {} end
local matched = 0
for _, h in ipairs(ARGV) do
  if redis.call('HEXISTS', K.bid, h) == 0 then break end
  matched = matched + 1
end
return {epoch, redis.call('HGET', K.meta, 'model'), num(K.meta, 'num_blocks'),
  redis.call('HLEN', K.bid), redis.call('ZCARD', K.free), matched}
