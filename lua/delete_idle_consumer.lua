--[[
  delete_idle_consumer: delete a consumer of a group, only while it has
  nothing pending (doctor --fix's idle-consumer fix, and a worker's own
  consumer as it exits gracefully).

  KEYS[1]  stream                    data

  ARGV[1]  group
  ARGV[2]  consumer

  Returns -1 when the consumer has pending entries (it is left alone), else
  what XGROUP DELCONSUMER returns (0: it had none).

  Invariant: a consumer is deleted only with an empty PEL share, checked in
  the same atomic step: checking first and deleting after would drop entries
  it read in between from the PEL, and nothing would ever reclaim them.
]]

local stream = KEYS[1]
local group, consumer = ARGV[1], ARGV[2]

if #redis.call("XPENDING", stream, group, "-", "+", 1, consumer) > 0 then
  return -1
end
return redis.call("XGROUP", "DELCONSUMER", stream, group, consumer)
