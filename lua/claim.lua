--[[
  claim: hand entries that sat idle in a consumer group's pending-entries
  list (PEL) to the calling consumer, for one or several streams in one call;
  per stream at most one consumer per lease period while its scan is idle.

  KEYS, five per stream, stream after stream (i = 0, 1, ...):
  KEYS[5i+1]  stream                 data, never given an expiry
  KEYS[5i+2]  lease key              coordination: holder name, always expires
  KEYS[5i+3]  cursor key             coordination: XAUTOCLAIM cursor, always expires
  KEYS[5i+4]  dead-letter stream     data, never given an expiry
  KEYS[5i+5]  started hash           coordination, always expires: entry id ->
                                     starts not followed by an ack (start.lua)

  ARGV[1]  group
  ARGV[2]  consumer                  the claimer, recorded as lease holder
  ARGV[3]  min_idle_ms               XAUTOCLAIM min-idle-time (idle_timeout)
  ARGV[4]  lease_ms                  lease lifetime
  ARGV[5]  cursor_ttl_ms             cursor lifetime
  ARGV[6]  max_deliveries            0: never dead-letter; else an entry
                                     whose task started max_deliveries times
                                     in workers that died running it goes to
                                     the dead-letter stream instead of the
                                     claimer. Reads and hand-backs of entries
                                     that never started do not count.
  ARGV[7]  delete_acked              "1": dead-lettered entries are acked with
                                     XACKDEL ... ACKED (Redis >= 8.2), as
                                     ack.lua acks; anything else: XACK only
  ARGV[8+i] count                    XAUTOCLAIM COUNT for stream i

  Returns one reply per stream, in KEYS order, each one of
    {"skipped", holder, lease_pttl_ms}
        another consumer holds the lease; nothing was claimed.
    {"claimed", next_cursor, {{id, {field, value, ...}, crashes}, ...},
     {trimmed_id, ...}, {{dead_lettered_id, data}, ...}, full}
        entries now owned by ARGV[2], each with its crashes (starts in
        workers that died running it; left out when ARGV[6] is 0); trimmed
        ids were pending but their stream entry is gone (trimmed or XDEL'd)
        and were removed from the PEL;
        dead-lettered ids reached max_deliveries crashes, were copied to the
        dead letters and acked (with ARGV[7] "1" also deleted from the
        stream once no group still needs them), and their start counts
        deleted; each comes with its "data" field (false when it has none)
        for the task's waiters. full is 1
        when XAUTOCLAIM filled COUNT (more may be idle): then no lease is
        taken (one held by the caller is dropped), so every claimer with
        room helps drain; else 0 and the caller holds the lease.
    {"failed", error}
        XAUTOCLAIM refused (e.g. NOGROUP); nothing changed for this stream.

  Invariant: the lease and the cursor key never exist without an expiry,
  whatever wrote them. The script runs atomically, so no client crash can
  leave the lease half-taken: either the claim and the lease both happened
  or neither did.
]]

--- @include "call_chunked"
--- @include "move_to_dead_letters"
--- @include "drop_if_data_gone"

local group, consumer = ARGV[1], ARGV[2]
local min_idle_ms, lease_ms, cursor_ttl_ms = ARGV[3], ARGV[4], ARGV[5]
local max_deliveries = tonumber(ARGV[6])
local delete_acked = ARGV[7] == "1"

local function claim_stream(stream, lease_key, cursor_key, dead_letters, started, count)
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

  local cursor = redis.call("GET", cursor_key)
  local start = cursor or "0-0"
  -- pcall: a stream that fails (say NOGROUP) must not take down the replies
  -- of streams claimed before it, whose entries are the caller's now.
  local reply = redis.pcall("XAUTOCLAIM", stream, group, consumer, min_idle_ms, start,
    "COUNT", count)
  if reply.err then
    return {"failed", reply.err}
  end
  local next_cursor = reply[1]
  local found = reply[2]
  local full = #found >= tonumber(count)

  -- Redis 6.2 returns a nil (false in Lua) in place of an entry that is
  -- gone from the stream and leaves it in the PEL; 7.x lists it in reply[3].
  local saw_vanished_entry = false
  for i = 1, #found do
    if not found[i] then
      saw_vanished_entry = true
      break
    end
  end
  local present = found
  if saw_vanished_entry then
    present = {}
    for _, entry in ipairs(found) do
      if entry then
        present[#present + 1] = entry
      end
    end
  end

  local claimed, trimmed, dead_lettered = present, {}, {}
  -- One hash read for the whole batch, and only if dead lettering is on:
  -- how often each entry's task started in a worker that then died without
  -- acking it (or handing it back).
  if max_deliveries > 0 and #present > 0 then
    local ids = {}
    for i, entry in ipairs(present) do
      ids[i] = entry[1]
    end
    local crashes = call_chunked({"HMGET", started}, ids, {})
    claimed = {}
    for i, entry in ipairs(present) do
      local crash_count = tonumber(crashes[i]) or 0
      if crash_count >= max_deliveries then
        local _, data = move_to_dead_letters(stream, dead_letters, group, entry[1],
          entry[2], crash_count, "max_deliveries exceeded", delete_acked)
        redis.call("HDEL", started, entry[1])
        dead_lettered[#dead_lettered + 1] = {entry[1], data}
      else
        entry[3] = crash_count
        claimed[#claimed + 1] = entry
      end
    end
  end

  if reply[3] then
    trimmed = reply[3]
    call_chunked({"HDEL", started}, trimmed, {})
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
    drop_if_data_gone(stream, group, started, ours, trimmed)
  end

  -- A full batch means a backlog: leave the lease free so every claimer
  -- with room takes a share. An idle scan holds it, so a crowd of idle
  -- claimers does not scan at once.
  if not full then
    redis.call("SET", lease_key, consumer, "PX", lease_ms)
  elseif holder then
    redis.call("DEL", lease_key)
  end
  if next_cursor ~= "0-0" then
    redis.call("SET", cursor_key, next_cursor, "PX", cursor_ttl_ms)
  elseif cursor then
    redis.call("DEL", cursor_key)
  end

  return {"claimed", next_cursor, claimed, trimmed, dead_lettered, full and 1 or 0}
end

local replies = {}
for i = 0, #KEYS / 5 - 1 do
  replies[i + 1] = claim_stream(KEYS[5 * i + 1], KEYS[5 * i + 2], KEYS[5 * i + 3],
    KEYS[5 * i + 4], KEYS[5 * i + 5], ARGV[8 + i])
end
return replies
