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

  Returns {next_start, {dropped_id, ...}}: next_start is "-" once the PEL's
  end was reached, else "(" .. the last id looked at.

  Invariant: acks only entries whose data is gone; creates no key and sets
  no expiry (it only deletes fields of the started hash).
]]

--- @include "drop_if_data_gone"

local stream, started = KEYS[1], KEYS[2]
local group, min_idle_ms, count, start = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local pending = redis.call("XPENDING", stream, group, "IDLE", min_idle_ms, start,
  "+", count)
local dropped = drop_if_data_gone(stream, group, started, pending, {})

local next_start = "-"
if #pending == tonumber(count) then
  next_start = "(" .. pending[#pending][1]
end
return {next_start, dropped}
