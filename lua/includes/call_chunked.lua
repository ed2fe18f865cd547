-- call_chunked(head, items, tail) -> reply
-- redis.call(head..., items..., tail...) for a list of any length, in calls
-- of at most 1000 items: unpack() of a whole list fails past Lua's C stack
-- (about 8000 values), after earlier commands of the script took effect.
-- Only for commands whose items are independent (HMGET, HDEL, XACK, XCLAIM
-- ... JUSTID, ...). The replies are joined: lists concatenated in order,
-- integers added. No items: no call, and an empty list.
local function call_chunked(head, items, tail)
  local joined = nil
  for first = 1, #items, 1000 do
    local args = {}
    for _, arg in ipairs(head) do
      args[#args + 1] = arg
    end
    for i = first, math.min(first + 999, #items) do
      args[#args + 1] = items[i]
    end
    for _, arg in ipairs(tail) do
      args[#args + 1] = arg
    end
    local reply = redis.call(unpack(args))
    if type(reply) == "table" then
      joined = joined or {}
      for _, value in ipairs(reply) do
        joined[#joined + 1] = value
      end
    else
      joined = (joined or 0) + reply
    end
  end
  return joined or {}
end
