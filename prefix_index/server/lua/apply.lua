-- ARGV: epoch, seq (0 = unchecked), digest of the ops (with seq), hot_threshold (0 = no
-- automatic pins, no hit history), window_ms, view_refresh_ms, engine_id, then the ops, each a
-- code and its arguments:
--   A admit n h1..hn | C h parent block_id | R n h1..hn | E k | P ttl_ms n h1..hn |
--   U n h1..hn | F h block_id | H n h1..hn | B blocks
--   (admit: 1 = admission, 0 = fork / re-sync; P: the pin named hn, covering the held prefix;
--   U: drops the pin named hn and the automatic pins among h1..hn; H: a re-sync re-stating
--   automatic pins; B: the engine's pin budget now)
-- Returns {results, pin_changes, replayed, view_writes}: one {status, detail, block_ids,
-- evicted (hash, id, ...), count} per op (status numbers are the proto's OpStatus), the pin
-- changes since the previous Apply as (hash, state, block_id, ...), 1 when seq was already
-- applied, and the writes due to Lookup's view, in order, as ('+' | '-', hash, ...): '+' for a
-- block committed, or hit while its entry was last written view_refresh_ms ago or more (the
-- view's TTL is twice that); '-' for a block dropped. The view writes are also published on
-- the residency channel (RESIDENCY_CHANNEL in keys.py), in this script, so a watcher sees every
-- engine's changes in the order they happened.
local OK, NOT_HELD, REFCOUNT_ZERO, BLOCK_IN_USE, HASH_EXISTS, ALREADY_COMMITTED,
  PIN_BUDGET_EXCEEDED, BLOCK_MISMATCH = 0, 1, 2, 3, 4, 5, 6, 7

local err = check_epoch(ARGV[1])
if err then return err end
local seq, digest = tonumber(ARGV[2]), ARGV[3]
local threshold = tonumber(ARGV[4])
local window_ms = tonumber(ARGV[5])
local view_refresh_ms = tonumber(ARGV[6])
local num_blocks = num(K.meta, 'num_blocks')

-- The sequence number lives in meta, with the data it counts: a Redis that lost the last
-- writes (failover, restore) also lost their numbers, so the engine's next number is a gap.
if seq > 0 then
  local last = num(K.meta, 'seq')
  if seq == last and redis.call('HGET', K.meta, 'seq_digest') == digest then
    local stored = cmsgpack.unpack(redis.call('HGET', K.meta, 'seq_reply'))
    refresh_ttl(num(K.meta, 'lease_ms'))
    return {stored[1], stored[2], 1, stored[3]}  -- writing the view again is harmless
  end
  if seq ~= last + 1 then
    local why
    if seq > last + 1 then
      why = 'skips ahead of the last applied seq ' .. fmt(last) .. ': writes were lost ' ..
        '(a Redis failover or restore)'
    elseif seq == last then
      why = 'was applied already with other ops: a duplicated or mixed-up write'
    else
      why = 'is older than the last applied seq ' .. fmt(last) .. ': a replayed write'
    end
    return fail('SEQUENCE', 'apply seq ' .. fmt(seq) .. ' ' .. why ..
      '; register again and re-sync (seq restarts at 1)')
  end
end

local function hex(h)
  return (h:gsub('.', function(c) return string.format('%02x', c:byte()) end))
end

local function take_list(pos)
  local n = tonumber(ARGV[pos])
  local list = {}
  for i = 1, n do
    list[i] = ARGV[pos + i]
  end
  return list, pos + n + 1
end

local function check_block(path, field, block)
  if tonumber(block) >= num_blocks then
    return fail('INVALID', path .. field .. ': ' .. block .. ' is out of range; allowed 0..' ..
      (num_blocks - 1) .. ' (the pool size registered)')
  end
end

-- Parse and check every op before the first write: a refused batch changes nothing.
local ops = {}
local engine_id = ARGV[7]
local pos = 8
while pos <= #ARGV do
  local code = ARGV[pos]
  local op = {code = code}
  local path = 'ops[' .. #ops .. ']'
  if code == 'A' then
    op.admit = ARGV[pos + 1] == '1'
    op.list, pos = take_list(pos + 2)
  elseif code == 'R' or code == 'U' or code == 'W' or code == 'H' then
    op.list, pos = take_list(pos + 1)
  elseif code == 'C' then
    op.h, op.parent, op.block = ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
    local bad = check_block(path, '.commit.block_id', ARGV[pos + 3])
    if bad then return bad end
    pos = pos + 4
  elseif code == 'F' then
    op.h, op.block = ARGV[pos + 1], tonumber(ARGV[pos + 2])
    local bad = check_block(path, '.forget.block_id', ARGV[pos + 2])
    if bad then return bad end
    pos = pos + 3
  elseif code == 'E' then
    op.k = tonumber(ARGV[pos + 1])
    pos = pos + 2
    if op.k > num_blocks then
      return fail('INVALID', path .. '.evict.k: ' .. ARGV[pos - 1] ..
        ' is more than the pool size; allowed 0..' .. num_blocks)
    end
  elseif code == 'P' then
    op.ttl_ms = tonumber(ARGV[pos + 1])
    op.list, pos = take_list(pos + 2)
  elseif code == 'B' then
    op.blocks = tonumber(ARGV[pos + 1])
    pos = pos + 2
    if op.blocks > num_blocks then
      return fail('INVALID', path .. '.set_pin_budget.blocks: ' .. ARGV[pos - 1] ..
        ' is more than the pool size; allowed 0..' .. num_blocks)
    end
  else
    return fail('INVALID', path .. ': unknown op code ' .. tostring(code))
  end
  ops[#ops + 1] = op
end

local now = now_ms()
expire_pins(now)
local view_writes = {}

local function view_write(sign, h)
  view_writes[#view_writes + 1] = sign
  view_writes[#view_writes + 1] = h
end

-- The hashes of the held prefix of `chain` and their block ids (one HMGET per slice).
local function held_prefix(chain)
  local ids = hmget(K.bid, chain)
  local hashes, blocks = {}, {}
  for i, h in ipairs(chain) do
    if not ids[i] then break end
    hashes[i], blocks[i] = h, tonumber(ids[i])
  end
  return hashes, blocks
end

-- Bounded: past the cap, the hashes used longest ago leave the history.
local function trim_history()
  local over = redis.call('ZCARD', K.hage) - num(K.meta, 'history_cap')
  if over > 0 then
    local gone = redis.call('ZPOPMIN', K.hage, over)
    local names = {}
    for i = 1, #gone, 2 do names[#names + 1] = gone[i] end
    call_sliced('HDEL', K.hot, names)
  end
end

-- One more use of every hash of an admitted chain, held or not; returns the estimates. The
-- chain's leaf gets the oldest history tick, so trimming drops leaves before shared roots.
local function count_uses(chain)
  local n = #chain
  local packed = hmget(K.hot, chain)
  local clock = num(K.meta, 'hclock')
  local estimates, hot_args, age_args = {}, {}, {}
  for i, h in ipairs(chain) do
    local estimate, state = hot_update(packed[i], now, window_ms, 1)
    estimates[i] = estimate
    hot_args[2 * i - 1], hot_args[2 * i] = h, state
    age_args[2 * i - 1], age_args[2 * i] = clock + n - i + 1, h
  end
  call_sliced('HSET', K.hot, hot_args)
  call_sliced('ZADD', K.hage, age_args)
  redis.call('HSET', K.meta, 'hclock', clock + n)
  trim_history()
  return estimates
end

-- Automatic pin of a held block whose use estimate reached the threshold, within the budget
-- (one block; acquire does the same for a whole prefix with one read of the pins).
local function maybe_auto_pin(h, estimate)
  if threshold > 0 and estimate >= threshold and redis.call('HEXISTS', K.pin, h) == 0
      and redis.call('HLEN', K.pin) < pin_budget() then
    set_pin(h, 'a')
    settle(h)
  end
end

-- Batched: a few calls per chain rather than a few per hash (chains run to thousands).
-- Chains never repeat a hash (validated), so reading all refcounts first is exact.
local function acquire(op)
  local hashes, blocks = held_prefix(op.list)
  local n = #hashes
  if n > 0 then
    local refs = hmget(K.ref, hashes)
    local clock = num(K.meta, 'clock')
    local ref_args, last_args, now_used = {}, {}, {}
    for i, h in ipairs(hashes) do
      local ref = tonumber(refs[i] or '0') + 1
      if ref == 1 then now_used[#now_used + 1] = h end  -- was evictable (or pinned)
      ref_args[2 * i - 1], ref_args[2 * i] = h, ref
      last_args[2 * i - 1], last_args[2 * i] = h, clock + i  -- ticks stay unique
    end
    call_sliced('HSET', K.ref, ref_args)
    call_sliced('HSET', K.last, last_args)
    redis.call('HSET', K.meta, 'clock', clock + n)
    if #now_used > 0 then
      call_sliced('ZREM', K.free, now_used)
      call_sliced('ZREM', K.lru, now_used)
    end
    -- Renew the view entries of the hit blocks, at most once per view_refresh_ms each.
    local written = hmget(K.vref, hashes)
    local due = {}
    for i, h in ipairs(hashes) do
      if not written[i] or now - tonumber(written[i]) >= view_refresh_ms then
        view_write('+', h)
        due[#due + 1] = h
        due[#due + 1] = fmt(now)
      end
    end
    if #due > 0 then call_sliced('HSET', K.vref, due) end
  end
  if op.admit then
    if threshold > 0 then
      local estimates = count_uses(op.list)
      -- maybe_auto_pin per held hash, with one read of the pins for the whole prefix.
      local pins = hmget(K.pin, hashes)
      local pinned, budget = redis.call('HLEN', K.pin), pin_budget()
      for i = 1, n do
        if estimates[i] >= threshold and not pins[i] and pinned < budget then
          set_pin(hashes[i], 'a')
          settle(hashes[i])
          pinned = pinned + 1
        end
      end
    end
    redis.call('HINCRBY', K.meta, 'queries', #op.list)
    redis.call('HINCRBY', K.meta, 'hits', n)
  end
  return {OK, '', blocks, {}, n}
end

-- The automatic pins outside `skip` (a set), the least recently used first: what gives way
-- to an explicit pin. (A scan of the pins: only when the pins reach the budget, which is a
-- fraction of one engine's pool.)
local function autos_least_recent_first(skip)
  local flat = redis.call('HGETALL', K.pin)
  local autos = {}
  for i = 1, #flat, 2 do
    if flat[i + 1] == 'a' and not skip[flat[i]] then autos[#autos + 1] = flat[i] end
  end
  local lasts = hmget(K.last, autos)
  local order = {}
  for i = 1, #autos do order[i] = i end
  -- (A hash with no last use, which only partial key loss can make, goes first.)
  local function last(i) return tonumber(lasts[i]) or 0 end
  table.sort(order, function(a, b) return last(a) < last(b) end)
  local sorted = {}
  for i, j in ipairs(order) do sorted[i] = autos[j] end
  return sorted
end

local function commit(op)
  local h, parent, block = op.h, op.parent, op.block
  local existing = redis.call('HGET', K.bid, h)
  if existing then
    if tonumber(existing) == block then
      return {ALREADY_COMMITTED, 'hash ' .. hex(h) .. ' is already committed in block ' ..
        block, {block}, {}, 0}
    end
    return {HASH_EXISTS, 'hash ' .. hex(h) .. ' is already held in block ' .. existing,
      {tonumber(existing)}, {}, 0}
  end
  if parent ~= '' and redis.call('HEXISTS', K.bid, parent) == 0 then
    return {NOT_HELD, 'parent ' .. hex(parent) .. ' is not held; commit the chain in order',
      {}, {}, 0}
  end
  local owner = redis.call('HGET', K.own, block)
  if owner then
    return {BLOCK_IN_USE, 'block ' .. block .. ' still holds hash ' .. hex(owner) ..
      '; evict it before reusing the block', {}, {}, 0}
  end
  redis.call('HSET', K.bid, h, block)
  redis.call('HSET', K.own, block, h)
  redis.call('HSET', K.ref, h, 1)
  redis.call('HSET', K.par, h, parent)
  redis.call('HSET', K.last, h, tick())
  redis.call('HSET', K.vref, h, fmt(now))
  view_write('+', h)
  if parent ~= '' then
    redis.call('HINCRBY', K.kids, parent, 1)
    settle(parent)
  end
  settle(h)
  if num(K.cover, h) > 0 then
    -- A pin covering it lives on (the block was forgotten while pinned): it holds it again,
    -- within the budget as far as automatic pins can give way (its room may have gone to
    -- them meanwhile); the explicit pins alone may pass it, as after a shrink.
    local over = redis.call('HLEN', K.pin) + 1 - pin_budget()
    if over > 0 then
      local autos = autos_least_recent_first({})
      for i = 1, math.min(over, #autos) do unpin(autos[i]) end
    end
    set_pin(h, 'e')
    settle(h)
  elseif threshold > 0 then
    -- A block that keeps coming back is pinned as soon as it is held again, even though LRU
    -- dropped it between its visits: its uses outlived the eviction.
    maybe_auto_pin(h, hot_update(redis.call('HGET', K.hot, h), now, window_ms, 0))
  end
  return {OK, '', {block}, {}, 1}
end

local function release(op)
  local count = 0
  for _, h in ipairs(op.list) do
    if redis.call('HEXISTS', K.bid, h) == 0 then
      return {NOT_HELD, 'hash ' .. hex(h) .. ' is not held', {}, {}, count}
    end
    if num(K.ref, h) <= 0 then
      return {REFCOUNT_ZERO, 'hash ' .. hex(h) .. ' has refcount 0; release without acquire',
        {}, {}, count}
    end
    redis.call('HINCRBY', K.ref, h, -1)
    redis.call('HSET', K.last, h, tick())
    settle(h)
    count = count + 1
  end
  return {OK, '', {}, {}, count}
end

-- Drops one block. Its hit history stays, and so does its count of held children (only a
-- forgotten block can have some): a re-commit of it then finds the count right.
local function drop(h)
  local block = redis.call('HGET', K.bid, h)
  local parent = redis.call('HGET', K.par, h)
  if redis.call('HEXISTS', K.pin, h) == 1 then
    redis.call('HSET', K.pinchg, h, '-')
  end
  for _, key in ipairs({K.bid, K.ref, K.par, K.last, K.pin, K.vref}) do
    redis.call('HDEL', key, h)
  end
  redis.call('HDEL', K.own, block)
  redis.call('ZREM', K.free, h)
  redis.call('ZREM', K.lru, h)
  view_write('-', h)
  if parent and parent ~= '' then
    if redis.call('HINCRBY', K.kids, parent, -1) <= 0 then
      redis.call('HDEL', K.kids, parent)
    end
    settle(parent)
  end
  return tonumber(block)
end

local function evict(op)
  local victims = {}
  local count = 0
  while count < op.k do
    local oldest = redis.call('ZRANGE', K.lru, 0, 0)
    if #oldest == 0 then break end
    local h = oldest[1]
    victims[#victims + 1] = h
    victims[#victims + 1] = drop(h)
    count = count + 1
  end
  redis.call('HINCRBY', K.meta, 'evictions', count)
  return {OK, '', {}, victims, count}
end

local function forget(op)
  local existing = redis.call('HGET', K.bid, op.h)
  if not existing then
    return {NOT_HELD, 'hash ' .. hex(op.h) .. ' is not held', {}, {}, 0}
  end
  if tonumber(existing) ~= op.block then
    return {BLOCK_MISMATCH, 'hash ' .. hex(op.h) .. ' is held in block ' .. existing ..
      ', not ' .. op.block .. '; nothing dropped', {tonumber(existing)}, {}, 0}
  end
  drop(op.h)
  redis.call('HINCRBY', K.meta, 'forgets', 1)
  return {OK, '', {op.block}, {}, 1}
end

-- An explicit pin, whole: named by the chain's last hash, it covers the chain's held prefix.
-- Pinned again, it covers the held prefix now and keeps the later expiry (no TTL is latest).
local function pin(op)
  local hashes = held_prefix(op.list)
  if #hashes == 0 then return {OK, '', {}, {}, 0} end
  local name = op.list[#op.list]
  local old = redis.call('HGET', K.pins, name)
  if not old and redis.call('HLEN', K.pins) >= num_blocks then
    return {PIN_BUDGET_EXCEEDED, 'this engine has ' .. num_blocks .. ' pins, one per block ' ..
      'of its pool, the most it may keep; unpin one first', {}, {}, 0}
  end
  local pins = hmget(K.pin, hashes)
  local new_pins = 0
  for i = 1, #hashes do
    if not pins[i] then new_pins = new_pins + 1 end
  end
  local pinned, budget = redis.call('HLEN', K.pin), pin_budget()
  local over = pinned + new_pins - budget
  -- A pin adding no block (a TTL renewed) passes: the pins a shrunk budget kept must stay
  -- renewable, or the shrink would drop them when their TTL lapses.
  if over > 0 and new_pins > 0 then
    -- An explicit pin is an order, an automatic one our guess: automatic pins outside this
    -- prefix make room for it, the least recently used first. (A scan of the pins: an
    -- explicit pin over budget is rare, and the budget is a fraction of one engine's pool.)
    local in_prefix = {}
    for _, h in ipairs(hashes) do in_prefix[h] = true end
    local autos = autos_least_recent_first(in_prefix)
    if #autos < over then
      return {PIN_BUDGET_EXCEEDED, 'pinning ' .. new_pins .. ' more blocks would pass the pin ' ..
        'budget of ' .. budget .. ' (' .. pinned .. ' pinned, ' .. (pinned - #autos) ..
        ' of them explicitly or in this prefix)', {}, {}, 0}
    end
    for i = 1, over do unpin(autos[i]) end
  end
  -- The new cover first, then the old one's end: blocks in both never flap.
  cover_add(hashes)
  redis.call('HSET', K.pins, name, table.concat(hashes))
  if old then cover_remove(split_hashes(old)) end
  local expiry = redis.call('ZSCORE', K.pinexp, name)
  if op.ttl_ms == 0 then
    redis.call('ZREM', K.pinexp, name)
  elseif not old or expiry then
    local at = now + op.ttl_ms
    if expiry and tonumber(expiry) > at then at = tonumber(expiry) end
    redis.call('ZADD', K.pinexp, fmt(at), name)
  end  -- else the pin had no TTL, which is later than any: it keeps none
  return {OK, '', {}, {}, #hashes}
end

-- A re-sync re-stating automatic pins. The history decides, as for a commit; a hash with no
-- history (Redis lost it) is taken on the engine's word: its uses are set to the threshold,
-- so it cools like a pin just earned. Within the budget; no other pin gives way.
local function restore_auto_pins(op)
  local hashes = held_prefix(op.list)
  if threshold == 0 then return {OK, '', {}, {}, 0} end
  local packed = hmget(K.hot, hashes)
  local count = 0
  for i, h in ipairs(hashes) do
    local estimate = hot_update(packed[i], now, window_ms, 0)
    if not packed[i] then
      local _, state = hot_update(nil, now, window_ms, threshold)
      redis.call('HSET', K.hot, h, state)
      redis.call('ZADD', K.hage, redis.call('HINCRBY', K.meta, 'hclock', 1), h)
      estimate = threshold
    end
    maybe_auto_pin(h, estimate)
    if redis.call('HEXISTS', K.pin, h) == 1 then count = count + 1 end
  end
  trim_history()
  return {OK, '', {}, {}, count}
end

-- Drops the pin named by the chain's last hash, and the automatic pins among the chain's
-- blocks (nobody's pin: whoever unpins the prefix overrides the guess, which the hit history
-- may make again). Blocks another pin covers stay pinned. Returns how many blocks it unpinned.
local function unpin_automatic(list)
  local count = 0
  local pins = hmget(K.pin, list)
  for i, h in ipairs(list) do
    if pins[i] == 'a' then
      unpin(h)
      count = count + 1
    end
  end
  return count
end

local function unpin_op(op)
  if #op.list == 0 then return {OK, '', {}, {}, 0} end
  local count = drop_pin(op.list[#op.list])
  return {OK, '', {}, {}, count + unpin_automatic(op.list)}
end

-- Only the automatic pins among the chain's blocks (UnpinOp.automatic_only): an engine freeing
-- guessed pins for a lone request must not drop an explicit pin that happens to be named by
-- the same hash (one made before its chain's last block was held).
local function unpin_automatic_op(op)
  return {OK, '', {}, {}, unpin_automatic(op.list)}
end

-- The engine's budget now (it follows the pool's spare room). Shrinking it unpins automatic
-- pins, the least hot first (ties: the one whose history was used longest ago; a chain's
-- leaf gets the older history tick, so leaves go before their roots), down to the budget.
-- Explicit pins stay: each was made within the budget of its time.
local function set_pin_budget(op)
  redis.call('HSET', K.meta, 'pin_budget', op.blocks)
  local over = redis.call('HLEN', K.pin) - op.blocks
  if over <= 0 then return {OK, '', {}, {}, 0} end
  local flat = redis.call('HGETALL', K.pin)
  local autos = {}
  for i = 1, #flat, 2 do
    if flat[i + 1] == 'a' then autos[#autos + 1] = flat[i] end
  end
  local packed = hmget(K.hot, autos)
  local heat, age = {}, {}
  for i, h in ipairs(autos) do
    heat[i] = hot_update(packed[i], now, window_ms, 0)
    age[i] = tonumber(redis.call('ZSCORE', K.hage, h) or '0')
  end
  local order = {}
  for i = 1, #autos do order[i] = i end
  table.sort(order, function(a, b)
    if heat[a] ~= heat[b] then return heat[a] < heat[b] end
    return age[a] < age[b]
  end)
  local count = math.min(over, #autos)
  for i = 1, count do unpin(autos[order[i]]) end
  return {OK, '', {}, {}, count}
end

local handlers = {A = acquire, C = commit, R = release, E = evict, P = pin, U = unpin_op,
                  W = unpin_automatic_op, F = forget, H = restore_auto_pins, B = set_pin_budget}
local results = {}
for i, op in ipairs(ops) do
  results[i] = handlers[op.code](op)
end

-- Hand over the pin changes since the previous Apply (this one's included), once each.
local changes = {}
local pending = redis.call('HGETALL', K.pinchg)
for i = 1, #pending, 2 do
  local h = pending[i]
  changes[#changes + 1] = h
  changes[#changes + 1] = pending[i + 1]
  changes[#changes + 1] = tonumber(redis.call('HGET', K.bid, h) or '-1')
end
redis.call('DEL', K.pinchg)

if seq > 0 then
  redis.call('HSET', K.meta, 'seq', fmt(seq), 'seq_digest', digest,
    'seq_reply', cmsgpack.pack({results, changes, view_writes}))
end
refresh_ttl(num(K.meta, 'lease_ms'))
if #view_writes > 0 then
  redis.call('PUBLISH', RESIDENCY_CHANNEL,
    cmsgpack.pack({'A', engine_id, ARGV[1], '', view_writes}))
end
return {results, changes, 0, view_writes}
