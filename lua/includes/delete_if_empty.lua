-- Delete a consumer of the group only while it has nothing pending,
-- checked in the same atomic step: checking first and deleting after would
-- drop entries it read in between from the PEL, and nothing would ever
-- reclaim them. Returns -1 when it has pending entries (left alone), else
-- what XGROUP DELCONSUMER returns (0: it had none).
local function delete_if_empty(stream, group, consumer)
  if #redis.call("XPENDING", stream, group, "-", "+", 1, consumer) > 0 then
    return -1
  end
  return redis.call("XGROUP", "DELCONSUMER", stream, group, consumer)
end
