--[[
  dead_letter: move one pending entry the broker cannot run (e.g. it has no
  "data" field, data its formatter cannot parse, or a task the receiver
  dropped unacked) to the dead-letter stream and ack it from the group.

  KEYS[1]  stream                    data
  KEYS[2]  dead-letter stream        data, never given an expiry
  KEYS[3]  started hash              coordination, always expires: the
                                     entry's start count is deleted

  ARGV[1]  group
  ARGV[2]  entry id
  ARGV[3]  reason
  ARGV[4]  delete_acked              "1": ack with XACKDEL ... ACKED (Redis
                                     >= 8.2), deleting the entry from the
                                     stream once no group still needs it, as
                                     a task's ack does (task_records.py);
                                     anything else: XACK only
  ARGV[5]  deliveries                optional: the count to record as its
                                     deliveries (the start count, when it
                                     goes for max_deliveries); else the PEL's

  Returns {dead_letter_id, data} when moved (data: the entry's "data"
  field, false when it has none), {} when the entry was already gone from
  the stream (then it is only acked, so it cannot come back).

  Invariant: an entry leaves the PEL, or its stream, only together with its
  copy landing in the dead-letter stream; nothing is acked without a record.
]]

--- @include "move_to_dead_letters"

local stream, dead_letters, started = KEYS[1], KEYS[2], KEYS[3]
local group, id, reason = ARGV[1], ARGV[2], ARGV[3]
local delete_acked, recorded = ARGV[4] == "1", ARGV[5]

redis.call("HDEL", started, id)
local found = redis.call("XRANGE", stream, id, id)
if #found == 0 then
  redis.call("XACK", stream, group, id)
  return {}
end
local pending = redis.call("XPENDING", stream, group, id, id, 1)
local deliveries = 0
if recorded then
  deliveries = recorded
elseif #pending == 1 then
  deliveries = pending[1][4]
end
local dead_id, data = move_to_dead_letters(stream, dead_letters, group, id,
  found[1][2], deliveries, reason, delete_acked)
return {dead_id, data}
