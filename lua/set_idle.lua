--[[
  set_idle: set the idle time of pending entries the caller still owns: the
  in-flight heartbeat (idle 0: a long task is not reclaimed while its worker
  lives), or handing back entries it read but never started (idle =
  idle_timeout: the next claim by any worker takes them at once).

  KEYS[1]  stream                    data

  ARGV[1]  group
  ARGV[2]  consumer                  the caller
  ARGV[3]  idle_ms                   idle time to set
  ARGV[4]  orphans                   the consumer recreate_group gave a
                                     vanished group's started entries to:
                                     the caller takes back those it holds
  ARGV[5..n]  entry ids (the caller sends at most 1000 per call)

  Returns {id, ...}: the ids the caller no longer owns (claimed by another
  consumer, acked, or trimmed); those were left untouched.

  Invariant: never takes an entry from another worker's consumer, and never
  raises a delivery count (XCLAIM ... JUSTID). Writes no key.
]]

--- @include "call_chunked"
--- @include "split_owned"
--- @include "set_idle_of"

local stream = KEYS[1]
local group, consumer, idle_ms, orphans = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local ids = {}
for i = 5, #ARGV do
  ids[#ids + 1] = ARGV[i]
end
local owned, lost = split_owned(stream, group, consumer, ids, orphans)
set_idle_of(stream, group, consumer, idle_ms, owned)
return lost
