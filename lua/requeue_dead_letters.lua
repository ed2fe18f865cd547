--[[
  requeue_dead_letters: put dead letters back on their stream as new entries.

  KEYS[1]  dead-letter stream        data
  KEYS[2]  stream                    data

  ARGV[1..n]  dead-letter ids          entry ids in the dead-letter stream (the
                                     caller sends them in bounded batches)

  Returns {{dead_letter_id, new_stream_id}, ...} for each entry requeued.
  Ids that are not in the dead-letter stream are skipped.

  Invariant: an entry leaves the dead-letter stream only in the same atomic
  step that re-adds it to its stream, so a requeue never loses a message.
]]

local dead_letters, stream = KEYS[1], KEYS[2]

local moved = {}
for _, id in ipairs(ARGV) do
  local found = redis.call("XRANGE", dead_letters, id, id)
  if #found == 1 then
    local original = {}
    local fields = found[1][2]
    for i = 1, #fields, 2 do
      if string.sub(fields[i], 1, 12) ~= "dead_letter_" then
        original[#original + 1] = fields[i]
        original[#original + 1] = fields[i + 1]
      end
    end
    local new_id = redis.call("XADD", stream, "*", unpack(original))
    redis.call("XDEL", dead_letters, id)
    moved[#moved + 1] = {id, new_id}
  end
end
return moved
