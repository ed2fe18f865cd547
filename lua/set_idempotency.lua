--[[
  set_idempotency: how long and how many kicked task ids a stream remembers
  (Redis >= 8.6, idempotent XADD), set before the stream's first kick.
  XCFGSET needs the stream to exist; a stream that does not is created
  empty here, in the same atomic step, so no kick lands before the setting
  (an XCFGSET that changes the values forgets the ids remembered so far).

  KEYS[1]  stream                    data

  ARGV[1]  duration_s                IDMP-DURATION (idempotency_window)
  ARGV[2]  maxsize                   IDMP-MAXSIZE: ids kept per producer id

  Returns XCFGSET's reply ("OK").

  Invariant: never removes an entry (the empty stream is made by an XADD
  trimmed to nothing only when the key does not exist); sets no expiry
  (a stream is data).
]]

local stream = KEYS[1]
local duration_s, maxsize = ARGV[1], ARGV[2]

if redis.call("TYPE", stream).ok == "none" then
  redis.call("XADD", stream, "MAXLEN", "0", "*", "data", "")
end
return redis.call("XCFGSET", stream, "IDMP-DURATION", duration_s,
  "IDMP-MAXSIZE", maxsize)
