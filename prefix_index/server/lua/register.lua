-- ARGV: model_identity, block_size, num_blocks, lease_ms, pin_budget
-- Drops whatever the engine held and returns a new epoch: max(old + 1, now in microseconds),
-- so epochs keep rising even when Redis lost its data (a restart without persistence).
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local old = tonumber(redis.call('HGET', K.meta, 'epoch') or '0')
local epoch = math.max(old + 1, now_us)
redis.call('DEL', unpack(ALL_KEYS))
redis.call('HSET', K.meta, 'epoch', fmt(epoch), 'model', ARGV[1], 'block_size', ARGV[2],
  'num_blocks', ARGV[3], 'lease_ms', ARGV[4], 'pin_budget', ARGV[5], 'clock', 0,
  'queries', 0, 'hits', 0, 'evictions', 0)
redis.call('PEXPIRE', K.meta, ARGV[4])
return fmt(epoch)
