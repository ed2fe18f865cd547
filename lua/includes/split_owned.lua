-- split_owned(stream, group, consumer, ids, adoptable) -> owned, lost
-- Splits ids into those pending at consumer (or at adoptable, when given:
-- the orphans' consumer, see recreate_group) and the rest (claimed by
-- another consumer, acked, or trimmed). One XPENDING per id: callers send
-- bounded batches of their own in-flight entries.
local function split_owned(stream, group, consumer, ids, adoptable)
  local owned, lost = {}, {}
  for _, id in ipairs(ids) do
    local pending = redis.call("XPENDING", stream, group, id, id, 1)
    local owner = #pending == 1 and pending[1][2]
    if owner and (owner == consumer or owner == adoptable) then
      owned[#owned + 1] = id
    else
      lost[#lost + 1] = id
    end
  end
  return owned, lost
end
