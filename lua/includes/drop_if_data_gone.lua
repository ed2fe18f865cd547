-- drop_if_data_gone(stream, group, started, pending, dropped) -> dropped
-- For each XPENDING row in pending ({id, consumer, idle, deliveries}) whose
-- stream entry is gone (trimmed or XDEL'd while pending): XACK it, so it
-- leaves the PEL, delete its start count from the started hash, and append
-- its id to dropped. One XRANGE per row, which reads the whole entry: only
-- where XCLAIM keeps gone entries (Redis 6.2); callers pass a bounded page.
-- Needs call_chunked.
local function drop_if_data_gone(stream, group, started, pending, dropped)
  local gone = {}
  for _, row in ipairs(pending) do
    if #redis.call("XRANGE", stream, row[1], row[1]) == 0 then
      gone[#gone + 1] = row[1]
      dropped[#dropped + 1] = row[1]
    end
  end
  call_chunked({"XACK", stream, group}, gone, {})
  call_chunked({"HDEL", started}, gone, {})
  return dropped
end
