--[[
  claim: hand entries that sat idle in a consumer group's pending-entries
  list (PEL) to the calling consumer, for one or several streams in one call;
  per stream at most one consumer per lease period while its scan is idle.

  KEYS, six per stream, stream after stream (i = 0, 1, ...):
  KEYS[6i+1]  stream                 data, never given an expiry
  KEYS[6i+2]  lease key              coordination: holder name, always expires
  KEYS[6i+3]  cursor key             coordination: XAUTOCLAIM cursor, always expires
  KEYS[6i+4]  dead-letter stream     data, never given an expiry
  KEYS[6i+5]  started hash           coordination, always expires: entry id ->
                                     starts not followed by an ack
                                     (task_records.py)
  KEYS[6i+6]  reclaimed count        coordination, always expires: entries
                                     reclaimed lately (reclaim_count.py)

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
                                     a task's ack; anything else: XACK only
  ARGV[8]  reclaimed_ttl_ms          the reclaimed count's lifetime, renewed
                                     at each increment
  ARGV[9+i]  counts                  XAUTOCLAIM COUNT for stream i

  Returns one reply per stream, in KEYS order, each one of
    {"skipped", holder, lease_pttl_ms}
        another consumer holds the lease; nothing was claimed.
    {"claimed", next_cursor, {{id, crashes}, ...},
     {trimmed_id, ...}, {{dead_lettered_id, data}, ...}, full}
        ids of the entries now owned by ARGV[2], without their fields (the
        caller reads those; see below), added to the reclaimed count,
        each with its crashes
        (starts in workers that died running it; left out when ARGV[6] is
        0); trimmed ids were pending but their stream entry is gone
        (trimmed or XDEL'd) and were removed from the PEL (Redis 6.2 lists
        such ids among the claimed ones: the caller's read finds them
        gone);
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

  The claim reads no entry's fields but those of entries it dead-letters
  (XAUTOCLAIM ... JUSTID): the caller reads them with XRANGE, which changes
  no owner, and keeps only the entries it still owns (claim.py). A claim is
  a delivery: JUSTID leaves the delivery count as it is, so the script
  raises it (XCLAIM ... JUSTID RETRYCOUNT, on entries it took in this same
  step), as the claim of whole entries would.

  Invariant: the only owner changes are XAUTOCLAIM's, which checks each
  entry's idle time in this step, and the count raise, on entries this step
  gave the caller. The lease, the cursor and the reclaimed count never
  exist without an expiry, whatever wrote them (the count is raised and
  given its expiry in this step, and only when something was claimed). The script runs atomically, so no client
  crash can leave the lease half-taken: either the claim and the lease both
  happened or neither did.
]]

--- @include "call_chunked"
--- @include "move_to_dead_letters"

local group, consumer = ARGV[1], ARGV[2]
local min_idle_ms, lease_ms, cursor_ttl_ms = ARGV[3], ARGV[4], ARGV[5]
local max_deliveries = tonumber(ARGV[6])
local delete_acked = ARGV[7] == "1"
local reclaimed_ttl_ms = ARGV[8]

-- The claimed entries' delivery counts, one up each: what XAUTOCLAIM
-- without JUSTID does. Only on entries this script just gave the consumer,
-- so XCLAIM at min-idle-time 0 takes nothing from anyone. One XPENDING per
-- entry, only when something was claimed: claims of idle entries are rare.
local function raise_delivery_counts(stream, ids)
  local by_count = {}
  for _, id in ipairs(ids) do
    local row = redis.call("XPENDING", stream, group, id, id, 1)[1]
    if row then
      local count = row[4] + 1
      by_count[count] = by_count[count] or {}
      table.insert(by_count[count], id)
    end
  end
  for count, same in pairs(by_count) do
    call_chunked({"XCLAIM", stream, group, consumer, 0}, same,
      {"JUSTID", "RETRYCOUNT", count})
  end
end

-- An observation, never the claim's failure: pcall, so a server refusing
-- it (an ACL from before the key) leaves the claim whole. PEXPIRE follows
-- every INCRBY that went through (a worker refused PEXPIRE starts no task:
-- a start sets the started hash's expiry with it).
local function count_reclaimed(key, amount)
  if amount > 0 and type(redis.pcall("INCRBY", key, amount)) == "number" then
    redis.pcall("PEXPIRE", key, reclaimed_ttl_ms)
  end
end

local function claim_stream(stream, lease_key, cursor_key, dead_letters, started,
    reclaimed, count)
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
  -- JUSTID: no entry's fields pass through Lua (each would be converted to
  -- Lua values and back, blocking the server far longer than the read it
  -- serves). pcall: a stream that fails (say NOGROUP) must not take down
  -- the replies of streams claimed before it, whose entries are the
  -- caller's now.
  local reply = redis.pcall("XAUTOCLAIM", stream, group, consumer, min_idle_ms, start,
    "COUNT", count, "JUSTID")
  if reply.err then
    return {"failed", reply.err}
  end
  local next_cursor = reply[1]
  local found = reply[2]
  local full = #found >= tonumber(count)

  -- 7.x lists the pending ids whose entry is gone from the stream in
  -- reply[3] and removes them from the PEL. Redis 6.2 lists them among the
  -- claimed ids: the caller's read finds them gone and acks them.
  local trimmed = reply[3] or {}
  call_chunked({"HDEL", started}, trimmed, {})
  raise_delivery_counts(stream, found)

  local claimed, dead_lettered = {}, {}
  -- One hash read for the whole batch, and only if dead lettering is on:
  -- how often each entry's task started in a worker that then died without
  -- acking it (or handing it back).
  local crashes = {}
  if max_deliveries > 0 and #found > 0 then
    crashes = call_chunked({"HMGET", started}, found, {})
  end
  for i, id in ipairs(found) do
    local crash_count = tonumber(crashes[i]) or 0
    if max_deliveries > 0 and crash_count >= max_deliveries then
      -- Rare (max_deliveries crashes): only these entries' fields are read.
      local entry = redis.call("XRANGE", stream, id, id)[1]
      if entry then
        local _, data = move_to_dead_letters(stream, dead_letters, group, id, entry[2],
          crash_count, "max_deliveries exceeded", delete_acked)
        redis.call("HDEL", started, id)
        dead_lettered[#dead_lettered + 1] = {id, data}
      else
        -- Redis 6.2: claimed though gone from the stream; the caller's
        -- read finds it gone and acks it, as any other.
        claimed[#claimed + 1] = {id, crash_count}
      end
    elseif max_deliveries > 0 then
      claimed[#claimed + 1] = {id, crash_count}
    else
      claimed[#claimed + 1] = {id}
    end
  end
  count_reclaimed(reclaimed, #claimed)

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
for i = 0, #KEYS / 6 - 1 do
  replies[i + 1] = claim_stream(KEYS[6 * i + 1], KEYS[6 * i + 2], KEYS[6 * i + 3],
    KEYS[6 * i + 4], KEYS[6 * i + 5], KEYS[6 * i + 6], ARGV[9 + i])
end
return replies
