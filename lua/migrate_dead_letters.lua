--[[
  migrate_dead_letters: move dead letters from a key named the old way (shared
  by streams s and {s}) to the key of the stream and group each one records.

  KEYS[1]  old dead-letter stream    data
  KEYS[2]  new dead-letter stream    data (the caller groups ids by target)

  ARGV[1..n]  entry ids in KEYS[1] (the caller sends them in bounded batches)

  Returns the number of entries moved. Ids no longer in KEYS[1] are skipped;
  KEYS[1] is deleted once empty.
  An entry keeps its id (when it was dead-lettered) unless KEYS[2] already
  holds a later one; then it gets a new id.

  Invariant: an entry leaves KEYS[1] only in the same atomic step that adds
  it to KEYS[2]: a migration never loses a dead letter, even half done.
]]

local old, new = KEYS[1], KEYS[2]

local moved = 0
for _, id in ipairs(ARGV) do
  local found = redis.call("XRANGE", old, id, id)
  if #found == 1 then
    local fields = found[1][2]
    local added = redis.pcall("XADD", new, id, unpack(fields))
    if type(added) == "table" and added.err then
      redis.call("XADD", new, "*", unpack(fields))
    end
    redis.call("XDEL", old, id)
    moved = moved + 1
  end
end
if redis.call("XLEN", old) == 0 then
  redis.call("DEL", old)
end
return moved
