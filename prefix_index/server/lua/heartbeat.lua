-- ARGV: epoch. Extends the lease of every key of the engine; returns the lease (ms).
local err = check_epoch(ARGV[1])
if err then return err end
expire_pins(now_ms())
local lease_ms = num(K.meta, 'lease_ms')
refresh_ttl(lease_ms)
return lease_ms
