--[[
  start: record that the tasks of some pending entries start running, just
  before they run. A start not followed by an ack (or taken back by a
  graceful hand-back) is a crash while running: claim.lua dead-letters an
  entry once it has max_deliveries of them.

  KEYS[1]  started hash              coordination, always expires

  ARGV[1]  ttl_ms                    lifetime of the hash, renewed here
  ARGV[2..n]  entry ids              the entries whose tasks start now

  Returns the number of ids recorded.

  Invariant: the hash never exists without an expiry; if it lapses only crash
  counts reset, no entry is lost.
]]

local started = KEYS[1]
for i = 2, #ARGV do
  redis.call("HINCRBY", started, ARGV[i], 1)
end
redis.call("PEXPIRE", started, ARGV[1])
return #ARGV - 1
