-- drop_if_data_gone(stream, group, started, pending, dropped) -> dropped
-- For each XPENDING row in pending ({id, consumer, idle, deliveries}) whose
-- stream entry is gone (trimmed or XDEL'd while pending): XACK it, so it
-- leaves the PEL, delete its start count from the started hash, and append
-- its id to dropped. One XRANGE per row: callers pass a bounded page.
local function drop_if_data_gone(stream, group, started, pending, dropped)
  for _, row in ipairs(pending) do
    local id = row[1]
    if #redis.call("XRANGE", stream, id, id) == 0 then
      redis.call("XACK", stream, group, id)
      redis.call("HDEL", started, id)
      dropped[#dropped + 1] = id
    end
  end
  return dropped
end
