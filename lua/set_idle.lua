--[[
  set_idle: set the idle time of pending entries the caller still owns.
  With idle 0 it is the in-flight heartbeat (a long task is not reclaimed
  while its worker lives); with idle = idle_timeout it hands entries back at
  shutdown, so the next claim by any worker takes them at once.

  KEYS[1]  stream                    data

  ARGV[1]  group
  ARGV[2]  consumer                  the caller
  ARGV[3]  idle_ms                   idle time to set
  ARGV[4..n]  entry ids (the caller sends at most 1000 per call)

  Returns {id, ...}: the ids the caller no longer owns (claimed by another
  consumer, acked, or trimmed); those were left untouched.

  Invariant: never takes an entry from another consumer, and never raises a
  delivery count (XCLAIM ... JUSTID), so heartbeats and hand-backs do not
  push entries toward max_deliveries. Writes no key.
]]

local stream = KEYS[1]
local group, consumer, idle_ms = ARGV[1], ARGV[2], ARGV[3]

local owned, lost = {}, {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local pending = redis.call("XPENDING", stream, group, id, id, 1)
  if #pending == 1 and pending[1][2] == consumer then
    owned[#owned + 1] = id
  else
    lost[#lost + 1] = id
  end
end
if #owned > 0 then
  local args = {"XCLAIM", stream, group, consumer, 0}
  for _, id in ipairs(owned) do
    args[#args + 1] = id
  end
  args[#args + 1] = "IDLE"
  args[#args + 1] = idle_ms
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
return lost
