-- set_idle_of(stream, group, consumer, idle_ms, ids)
-- Sets the idle time of entries the consumer owns, without raising their
-- delivery count (XCLAIM ... JUSTID to their owner).
local function set_idle_of(stream, group, consumer, idle_ms, ids)
  if #ids == 0 then
    return
  end
  local args = {"XCLAIM", stream, group, consumer, 0}
  for _, id in ipairs(ids) do
    args[#args + 1] = id
  end
  args[#args + 1] = "IDLE"
  args[#args + 1] = idle_ms
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
