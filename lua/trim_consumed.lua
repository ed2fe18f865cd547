--[[
  trim_consumed: remove from a stream the entries no consumer group needs
  any more (XACK only clears the PEL: without this the stream keeps every
  task ever kicked), at most once per interval for the whole fleet.

  KEYS[1]  stream                    data: trimmed only below what every
                                     group still needs
  KEYS[2]  trim gate                 coordination, always expires: set with
                                     PX interval_ms when this call trims

  ARGV[1]  interval_ms               the gate's lifetime: the fleet trims the
                                     stream at most once per interval
  ARGV[2]  keep_from_ms              0, or keep entries whose id's time is
                                     at least this (ms since the epoch)
  ARGV[3]  limit                     XTRIM ... LIMIT: at most this many
                                     entries removed per call

  Returns {trimmed, bound}: trimmed is -1 when the gate was set (another
  call trimmed within interval_ms: nothing done), else how many entries
  XTRIM removed; bound is the MINID trimmed below, "" when nothing may go
  (no stream, no group, or a group that still needs its first entry).

  Invariant: for every group of the stream, only entries below both its
  oldest pending entry (XPENDING) and its last-delivered-id are removed, so
  no group loses an entry it has not read or not acked; a stream without
  groups keeps everything (a group created later from an id may read it).
  XTRIM ... ~ removes only whole nodes below the bound. Reads no entry.
]]

-- Stream ids "ms-seq" as Redis writes them (no leading zeros), compared
-- as decimal strings: each part may exceed what a Lua number holds exactly.
local function part_less(a, b)
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end

local function id_less(a, b)
  local a_ms, a_seq = string.match(a, "^(%d+)-(%d+)$")
  local b_ms, b_seq = string.match(b, "^(%d+)-(%d+)$")
  if a_ms ~= b_ms then
    return part_less(a_ms, b_ms)
  end
  return part_less(a_seq, b_seq)
end

local stream, gate = KEYS[1], KEYS[2]
local interval_ms, keep_from_ms = ARGV[1], ARGV[2]
local limit = ARGV[3]

local gated = redis.pcall("SET", gate, "1", "NX", "PX", interval_ms)
if not gated then
  return {-1, ""}
end
-- An error reply (out of memory on Redis 6.2, which refuses the SET of a
-- script without flags): trim anyway, which frees memory.

if redis.call("TYPE", stream).ok ~= "stream" then
  return {0, ""}
end
local bound = nil
for _, fields in ipairs(redis.call("XINFO", "GROUPS", stream)) do
  local group = {}
  for i = 1, #fields, 2 do
    group[fields[i]] = fields[i + 1]
  end
  -- Entries after last-delivered-id are unread; the id itself was read
  -- (pending, or acked and kept as the bound: one entry of slack).
  local needed = group["last-delivered-id"]
  local summary = redis.call("XPENDING", stream, group.name)
  if summary[1] > 0 and id_less(summary[2], needed) then
    needed = summary[2]
  end
  if bound == nil or id_less(needed, bound) then
    bound = needed
  end
end
if bound == nil or bound == "0-0" then
  return {0, ""}
end
if keep_from_ms ~= "0" then
  local kept = keep_from_ms .. "-0"
  if id_less(kept, bound) then
    bound = kept
  end
end
return {redis.call("XTRIM", stream, "MINID", "~", bound, "LIMIT", limit), bound}
