--[[
  delete_idle_consumer: delete a consumer of a group, only while it has
  nothing pending (doctor --fix's idle-consumer fix).

  KEYS[1]  stream                    data

  ARGV[1]  group
  ARGV[2]  consumer

  Returns -1 when the consumer has pending entries (it is left alone), else
  what XGROUP DELCONSUMER returns (0: it had none).

  Invariant: a consumer is deleted only with an empty PEL share, checked in
  the same atomic step: checking first and deleting after would drop entries
  it read in between from the PEL, and nothing would ever reclaim them.
]]

--- @include "delete_if_empty"

return delete_if_empty(KEYS[1], ARGV[1], ARGV[2])
