--[[
  leave_group: a worker's graceful exit. Delete its own consumer if it owns
  nothing pending, and every other consumer of the group that owns nothing
  pending and has not talked to the server for min_idle_ms: consumers of
  workers that exited or died owning entries that others have taken since
  (a child recycled by --max-tasks-per-child hands back what it read
  beyond its last task, so it still owns entries as it exits).

  KEYS[1]  stream                    data

  ARGV[1]  group
  ARGV[2]  consumer                  the caller's own
  ARGV[3]  min_idle_ms               another consumer's least idle time

  Returns {own, others}: own is -1 when the caller's consumer still has
  pending entries (it is left alone), else what XGROUP DELCONSUMER returned;
  others is how many other consumers were deleted.

  Invariant: a consumer is deleted only with an empty PEL share, read and
  deleted in one atomic step, so no entry ever leaves the PEL. A live
  consumer deleted so loses nothing either: its next read creates it again
  (and min_idle_ms, at least idle_timeout, is past any listening worker's
  read block).
]]

--- @include "delete_if_empty"

local stream = KEYS[1]
local group, own, min_idle = ARGV[1], ARGV[2], tonumber(ARGV[3])

local own_reply = delete_if_empty(stream, group, own)
local others = 0
for _, fields in ipairs(redis.call("XINFO", "CONSUMERS", stream, group)) do
  local consumer = {}
  for i = 1, #fields, 2 do
    consumer[fields[i]] = fields[i + 1]
  end
  if consumer.name ~= own and consumer.pending == 0 and consumer.idle >= min_idle then
    redis.call("XGROUP", "DELCONSUMER", stream, group, consumer.name)
    others = others + 1
  end
end
return {own_reply, others}
