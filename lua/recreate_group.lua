--[[
  recreate_group: create a consumer group that vanished (an operator's
  XGROUP DESTROY, say) at start, and give the entries it had started and
  not acked back to a consumer of the new group: the orphans' consumer, no
  worker's, so they are reclaimed once idle as a dead worker's are. Their
  pending list went with the old group; the started hash, a key of its
  own, still names them. A live worker takes its own back at its next
  heartbeat (set_idle), long before they turn idle.

  KEYS[1]  stream                    data
  KEYS[2]  started hash              coordination, read only here

  ARGV[1]  group
  ARGV[2]  start                     the id the group is created at
  ARGV[3]  orphans                   the consumer the adopted entries go to
  ARGV[4]  mkstream                  "1": create the stream if it is missing

  Returns -1 when the group exists already (another worker re-created it
  first), else how many entries were adopted.

  Invariant: an entry gets an owner here only if it is pending for no
  consumer and still in the stream, checked in this step; only entries at
  or before start (those after it the new group delivers anyway); no
  delivery count is raised (JUSTID). Writes no key but the group.
]]

local stream, started = KEYS[1], KEYS[2]
local group, start, orphans, mkstream = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

-- Read before any write: refused (an ACL from before this script), the
-- script ends having changed nothing.
local fields = redis.call("HKEYS", started)

local create = {"XGROUP", "CREATE", stream, group, start}
if mkstream == "1" then
  create[#create + 1] = "MKSTREAM"
end
local created = redis.pcall(unpack(create))
if type(created) == "table" and created.err then
  if string.find(created.err, "BUSYGROUP", 1, true) then
    return -1
  end
  return redis.error_reply(created.err)
end

local function id_parts(id)
  local ms, seq = string.match(id, "^(%d+)%-(%d+)$")
  if ms == nil then
    return nil
  end
  return tonumber(ms), tonumber(seq)
end

local start_ms, start_seq = id_parts(start)
if start_ms == nil then
  return 0 -- "0" or "$": nothing before it belongs to the old group
end

local adopted = 0
for _, id in ipairs(fields) do
  local ms, seq = id_parts(id)
  -- Not every field is an entry id (task_records.KEEP_HASHTABLE_FIELD).
  if ms ~= nil and (ms < start_ms or (ms == start_ms and seq <= start_seq))
    and #redis.call("XPENDING", stream, group, id, id, 1) == 0
    and #redis.call("XRANGE", stream, id, id) == 1 then
    redis.call("XCLAIM", stream, group, orphans, 0, id, "FORCE", "JUSTID")
    adopted = adopted + 1
  end
end
return adopted
