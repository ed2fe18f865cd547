"""The one view of a client the package's own calls need."""

from __future__ import annotations

from typing import Any, Protocol


class ScriptClient(Protocol):
    """What every command goes through: redis-py's asyncio ``Redis`` and
    ``RedisCluster``, and ``SlotRoutedClient``, all have it (redis-py leaves
    it unannotated, which strict typing refuses to call)."""

    async def execute_command(self, *args: Any, **options: Any) -> Any: ...
