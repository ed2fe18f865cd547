--[[
  drop_trimmed: find pending entries whose stream data is gone (trimmed or
  XDEL'd while pending) and remove them from the PEL, as the claim does.
  Reads that reclaim (XREADGROUP ... CLAIM, Redis >= 8.4) skip such entries
  and leave them pending for ever; this sweep, run about once per
  idle_timeout, is their only way out.

  KEYS[1]  stream                    data
  KEYS[2]  started hash              coordination, always expires: the
                                     dropped entries' start counts are deleted

  ARGV[1]  group
  ARGV[2]  min_idle_ms               only entries idle this long (idle_timeout):
                                     as the claim, never one a live worker holds
  ARGV[3]  count                     PEL entries looked at per call
  ARGV[4]  start                     first id to look at ("-", or "(id")
  ARGV[5]  consumer                  the caller (XCLAIM names it; see below)

  Returns {next_start, {dropped_id, ...}}: next_start is "-" once the PEL's
  end was reached, else "(" .. the last id looked at.

  Invariant: acks only entries whose data is gone; creates no key but the
  caller's consumer, and sets no expiry (it only deletes fields of the
  started hash). Reads no entry's fields on Redis/Valkey >= 7, so a sweep
  costs about the same whatever the payloads' size.
]]

--- @include "call_chunked"
--- @include "drop_if_data_gone"

local stream, started = KEYS[1], KEYS[2]
local group, min_idle_ms, count, start = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local consumer = ARGV[5]

local pending = redis.call("XPENDING", stream, group, "IDLE", min_idle_ms, start,
  "+", count)
local next_start = "-"
if #pending == tonumber(count) then
  next_start = "(" .. pending[#pending][1]
end
if #pending == 0 then
  return {next_start, {}}
end

if not redis.REDIS_VERSION_NUM then
  -- Redis 6.2: XCLAIM keeps gone entries pending.
  return {next_start, drop_if_data_gone(stream, group, started, pending, {})}
end

-- XCLAIM removes from the PEL each listed id whose entry is gone (>= 7.0),
-- before it checks min-idle-time; at a min-idle-time no entry reaches, it
-- claims nothing, so every entry still there keeps its owner, idle time and
-- delivery count. Its only other effect is on the named consumer (created
-- if missing, seen now): the caller, which is alive.
local ids = {}
for i, row in ipairs(pending) do
  ids[i] = row[1]
end
call_chunked({"XCLAIM", stream, group, consumer, "9223372036854775807"}, ids,
  {"JUSTID"})
-- What the same page holds now: idle times only grew, so every entry kept
-- is in it.
local kept = {}
for _, row in ipairs(redis.call("XPENDING", stream, group, "IDLE", min_idle_ms,
    start, ids[#ids], count)) do
  kept[row[1]] = true
end
local dropped = {}
for _, id in ipairs(ids) do
  if not kept[id] then
    dropped[#dropped + 1] = id
  end
end
call_chunked({"HDEL", started}, dropped, {})
return {next_start, dropped}
