-- move_to_dead_letters(stream, dead_letters, group, id, fields, deliveries, reason)
-- Copies one entry, with where it came from and why, to the dead-letter
-- stream and acks it from the group. The original stays in its stream (other
-- groups may still need it); the dead-letter stream is data: never expires.
-- Returns the dead-letter entry's id.
local function move_to_dead_letters(stream, dead_letters, group, id, fields,
                                    deliveries, reason)
  local record = {}
  for i = 1, #fields do
    record[i] = fields[i]
  end
  local n = #record
  record[n + 1], record[n + 2] = "dead_letter_stream", stream
  record[n + 3], record[n + 4] = "dead_letter_group", group
  record[n + 5], record[n + 6] = "dead_letter_id", id
  record[n + 7], record[n + 8] = "dead_letter_deliveries", tostring(deliveries)
  record[n + 9], record[n + 10] = "dead_letter_reason", reason
  local dead_id = redis.call("XADD", dead_letters, "*", unpack(record))
  redis.call("XACK", stream, group, id)
  return dead_id
end
