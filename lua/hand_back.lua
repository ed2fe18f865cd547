--[[
  hand_back: at graceful shutdown, set the idle time of some of the caller's
  unacked entries and take back the start it recorded for each task that
  started here but was interrupted by the shutdown: a shutdown is not a
  crash, so it must not count toward max_deliveries. Idle idle_timeout makes
  entries no task runs claimable at once; idle 0 is the last heartbeat of
  entries whose task still runs as the shutdown ends: claimable idle_timeout
  later, when the process is gone.

  KEYS[1]  stream                    data
  KEYS[2]  started hash              coordination, always expires

  ARGV[1]  group
  ARGV[2]  consumer                  the caller
  ARGV[3]  idle_ms                   idle time to set (idle_timeout or 0)
  ARGV[4]  n_started                 the first n_started ids had a start
                                     recorded here
  ARGV[5..]  entry ids (the caller sends at most 1000 per call)

  Returns {id, ...}: the ids the caller no longer owns; those were left
  untouched, their start counts included (whoever reclaimed them judged them).

  Invariant: never takes an entry from another consumer, never raises a
  delivery count, and a start count never goes below zero: a field at zero is
  deleted; HINCRBY on a key that expired meanwhile is undone at once.
]]

--- @include "call_chunked"
--- @include "split_owned"
--- @include "set_idle_of"

local stream, started = KEYS[1], KEYS[2]
local group, consumer, idle_ms = ARGV[1], ARGV[2], ARGV[3]
local n_started = tonumber(ARGV[4])

local ids, was_started = {}, {}
for i = 5, #ARGV do
  ids[#ids + 1] = ARGV[i]
end
for i = 5, 4 + n_started do
  was_started[ARGV[i]] = true
end
local owned, lost = split_owned(stream, group, consumer, ids)
set_idle_of(stream, group, consumer, idle_ms, owned)
for _, id in ipairs(owned) do
  if was_started[id] and redis.call("HINCRBY", started, id, -1) <= 0 then
    redis.call("HDEL", started, id)
  end
end
return lost
