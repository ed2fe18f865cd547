-- set_idle_of(stream, group, consumer, idle_ms, ids)
-- Sets the idle time of entries the consumer owns, without raising their
-- delivery count (XCLAIM ... JUSTID to their owner). Needs call_chunked.
local function set_idle_of(stream, group, consumer, idle_ms, ids)
  call_chunked({"XCLAIM", stream, group, consumer, 0}, ids, {"IDLE", idle_ms, "JUSTID"})
end
