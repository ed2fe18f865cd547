-- move_to_dead_letters(stream, dead_letters, group, id, fields, deliveries, reason,
--                      delete_acked)
-- Copies one entry, with where it came from and why, to the dead-letter
-- stream and acks it from the group, as a task's ack does: with delete_acked
-- (XACKDEL ... ACKED) the original is deleted once no group still needs it,
-- else it stays in its stream (other groups may still need it). The copy is
-- written first, in the same script: nothing is deleted without a record.
-- The dead-letter stream is data: never expires.
-- Returns the dead-letter entry's id and the entry's "data" field (false
-- when it has none): whoever waits on its task learns from that (see
-- dead_letter_results.py).
local function move_to_dead_letters(stream, dead_letters, group, id, fields,
                                    deliveries, reason, delete_acked)
  local record, data = {}, false
  for i = 1, #fields do
    record[i] = fields[i]
    if i % 2 == 0 and fields[i - 1] == "data" then
      data = fields[i]
    end
  end
  local n = #record
  record[n + 1], record[n + 2] = "dead_letter_stream", stream
  record[n + 3], record[n + 4] = "dead_letter_group", group
  record[n + 5], record[n + 6] = "dead_letter_id", id
  record[n + 7], record[n + 8] = "dead_letter_deliveries", tostring(deliveries)
  record[n + 9], record[n + 10] = "dead_letter_reason", reason
  local dead_id = redis.call("XADD", dead_letters, "*", unpack(record))
  if delete_acked then
    redis.call("XACKDEL", stream, group, "ACKED", "IDS", 1, id)
  else
    redis.call("XACK", stream, group, id)
  end
  return dead_id, data
end
