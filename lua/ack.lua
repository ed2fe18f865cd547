--[[
  ack: acknowledge one entry and forget its start count, in one round trip.

  KEYS[1]  stream                    data
  KEYS[2]  started hash              coordination, always expires

  ARGV[1]  group
  ARGV[2]  entry id

  Returns XACK's reply: 1 if the entry was pending, else 0.

  Invariant: writes no key; HDEL of the last field deletes the hash.
]]

local stream, started = KEYS[1], KEYS[2]
local group, id = ARGV[1], ARGV[2]

local acked = redis.call("XACK", stream, group, id)
redis.call("HDEL", started, id)
return acked
