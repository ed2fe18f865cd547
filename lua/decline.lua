--[[
  decline: the caller's worker does not know the task of one entry it holds.
  Unless the entry was delivered bound times already, hand it back: claimable
  at once (idle = idle_timeout) by a worker that may know the task.

  KEYS[1]  stream                    data

  ARGV[1]  group
  ARGV[2]  consumer                  the caller
  ARGV[3]  idle_ms                   idle time to set (idle_timeout)
  ARGV[4]  bound                     deliveries after which it is not handed back
  ARGV[5]  entry id

  Returns the entry's delivery count (the PEL's: the read and every claim,
  Lua or XREADGROUP ... CLAIM, raised it): below bound it was handed back; at
  or above bound nothing changed (the caller moves it to the dead letters).
  Returns -1 when the caller no longer owns it: nothing changed.

  Invariant: never takes an entry from another consumer, never raises a
  delivery count (XCLAIM ... JUSTID), writes no key.
]]

--- @include "call_chunked"
--- @include "set_idle_of"

local stream = KEYS[1]
local group, consumer, idle_ms = ARGV[1], ARGV[2], ARGV[3]
local bound, id = tonumber(ARGV[4]), ARGV[5]

local pending = redis.call("XPENDING", stream, group, id, id, 1)
if #pending == 0 or pending[1][2] ~= consumer then
  return -1
end
local deliveries = pending[1][4]
if deliveries < bound then
  set_idle_of(stream, group, consumer, idle_ms, {id})
end
return deliveries
