-- Read-only. The engine's resident block hashes for a residency watcher's snapshot:
-- {epoch, model, {hash, ...}}, or {} when gone. (A pool of 100k blocks takes ~10 ms here; a
-- watcher asks once per connection.)
local epoch = redis.call('HGET', K.meta, 'epoch')
if not epoch then return {} end
return {epoch, redis.call('HGET', K.meta, 'model'), redis.call('HKEYS', K.bid)}
