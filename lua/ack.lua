--[[
  ack: acknowledge one entry and forget its start count, in one round trip;
  optionally delete the entry once every group acked it.

  KEYS[1]  stream                    data
  KEYS[2]  started hash              coordination, always expires

  ARGV[1]  group
  ARGV[2]  entry id
  ARGV[3]  delete_acked              "1": ack with XACKDEL ... ACKED (Redis
                                     >= 8.2), deleting the entry from the
                                     stream once no group still needs it;
                                     anything else: XACK only

  Returns 1 if the entry was pending in the group, else 0.

  Invariant: writes no key; HDEL of the last field deletes the hash. With
  ARGV[3] "1" an entry another group has not acked stays in the stream.
]]

local stream, started = KEYS[1], KEYS[2]
local group, id, delete_acked = ARGV[1], ARGV[2], ARGV[3] == "1"

local acked
if delete_acked then
  -- Per id: -1 not pending in this group, 1 acked and deleted, 2 acked and
  -- kept for another group.
  local reply = redis.call("XACKDEL", stream, group, "ACKED", "IDS", 1, id)
  acked = reply[1] == -1 and 0 or 1
else
  acked = redis.call("XACK", stream, group, id)
end
redis.call("HDEL", started, id)
return acked
