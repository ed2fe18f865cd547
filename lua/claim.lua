--[[
  claim: hand entries that sat idle in a consumer group's pending-entries
  list (PEL) to the calling consumer, at most one consumer per lease period.

  KEYS[1]  stream                    data, never given an expiry
  KEYS[2]  lease key                 coordination: holder name, always expires
  KEYS[3]  cursor key                coordination: XAUTOCLAIM cursor, always expires
  KEYS[4]  dead-letter stream        data, never given an expiry
  KEYS[5]  started hash              coordination, always expires: entry id ->
                                     starts not followed by an ack (start.lua)

  ARGV[1]  group
  ARGV[2]  consumer                  the claimer, recorded as lease holder
  ARGV[3]  min_idle_ms               XAUTOCLAIM min-idle-time (idle_timeout)
  ARGV[4]  count                     XAUTOCLAIM COUNT (unacknowledged_batch_size)
  ARGV[5]  lease_ms                  lease lifetime
  ARGV[6]  cursor_ttl_ms             cursor lifetime
  ARGV[7]  max_deliveries            0: never dead-letter; else an entry
                                     whose task started max_deliveries times
                                     in workers that died running it goes to
                                     KEYS[4] instead of the claimer. Reads
                                     and hand-backs of entries that never
                                     started do not count.

  Returns one of
    {"skipped", holder, lease_pttl_ms}
        another consumer holds the lease; nothing was claimed.
    {"claimed", next_cursor, {{id, {field, value, ...}}, ...}, {trimmed_id, ...},
     {dead_lettered_id, ...}}
        entries now owned by ARGV[2]; trimmed ids were pending but their
        stream entry is gone (trimmed or XDEL'd) and were removed from the PEL;
        dead-lettered ids reached max_deliveries crashes, were copied to
        KEYS[4] and acked, and their start counts deleted.

  Invariant: the lease and the cursor key never exist without an expiry,
  whatever wrote them. The script runs atomically, so no client crash can
  leave the lease half-taken: either the claim and the lease both happened
  or neither did.
]]

--- @include "move_to_dead_letters"

local stream, lease_key, cursor_key, dead_letters = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local started = KEYS[5]
local group, consumer = ARGV[1], ARGV[2]
local min_idle_ms, count = ARGV[3], ARGV[4]
local lease_ms, cursor_ttl_ms = ARGV[5], ARGV[6]
local max_deliveries = tonumber(ARGV[7])

local holder = redis.call("GET", lease_key)
if holder and holder ~= consumer then
  local lease_pttl = redis.call("PTTL", lease_key)
  if lease_pttl < 0 then
    -- Written without an expiry by something else: bound it, or it would
    -- block every claimer forever.
    redis.call("PEXPIRE", lease_key, lease_ms)
    lease_pttl = tonumber(lease_ms)
  end
  return {"skipped", holder, lease_pttl}
end

local start = redis.call("GET", cursor_key) or "0-0"
local reply = redis.call("XAUTOCLAIM", stream, group, consumer, min_idle_ms, start,
  "COUNT", count)
local next_cursor = reply[1]

local claimed, trimmed, dead_lettered = {}, {}, {}
local saw_vanished_entry = false
local present = {}
for _, entry in ipairs(reply[2]) do
  if entry then
    present[#present + 1] = entry
  else
    -- Redis 6.2 returns a nil in place of an entry that is gone from the
    -- stream and leaves it in the PEL; 7.x lists it in reply[3] instead.
    saw_vanished_entry = true
  end
end

-- One hash read for the whole batch: how often each entry's task started
-- in a worker that then died without acking it (or handing it back).
local crashes = {}
if max_deliveries > 0 and #present > 0 then
  local ids = {}
  for i, entry in ipairs(present) do
    ids[i] = entry[1]
  end
  crashes = redis.call("HMGET", started, unpack(ids))
end
for i, entry in ipairs(present) do
  local crash_count = tonumber(crashes[i]) or 0
  if max_deliveries > 0 and crash_count >= max_deliveries then
    move_to_dead_letters(stream, dead_letters, group, entry[1], entry[2], crash_count,
      "max_deliveries exceeded")
    redis.call("HDEL", started, entry[1])
    dead_lettered[#dead_lettered + 1] = entry[1]
  else
    claimed[#claimed + 1] = entry
  end
end

if reply[3] then
  for _, id in ipairs(reply[3]) do
    trimmed[#trimmed + 1] = id
    redis.call("HDEL", started, id)
  end
end

if saw_vanished_entry then
  -- 6.2 gave no ids. The vanished entries are now ours and lie inside the
  -- range XAUTOCLAIM scanned, which holds at most COUNT*10 PEL entries.
  local range_end = "+"
  if next_cursor ~= "0-0" then
    range_end = "(" .. next_cursor
  end
  local ours = redis.call("XPENDING", stream, group, start, range_end,
    tonumber(count) * 10, consumer)
  for _, pending in ipairs(ours) do
    local id = pending[1]
    if #redis.call("XRANGE", stream, id, id) == 0 then
      redis.call("XACK", stream, group, id)
      redis.call("HDEL", started, id)
      trimmed[#trimmed + 1] = id
    end
  end
end

redis.call("SET", lease_key, consumer, "PX", lease_ms)
if next_cursor == "0-0" then
  redis.call("DEL", cursor_key)
else
  redis.call("SET", cursor_key, next_cursor, "PX", cursor_ttl_ms)
end

return {"claimed", next_cursor, claimed, trimmed, dead_lettered}
