"""State TTL: a user's session expires 30 minutes after its last access, and a read counts
as an access (ON_READ_AND_WRITE). Time is a ManualClock moved by the test driver."""

import asyncio

import asyncstate as ast

MINUTE = 60_000

session_ttl = (ast.StateTtlConfig.new_builder(30 * MINUTE)
               .set_update_type(ast.UpdateType.ON_READ_AND_WRITE)
               .set_state_visibility(ast.StateVisibility.NEVER_RETURN_EXPIRED)
               .cleanup_full_snapshot()
               .build())


class Sessions(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.page = ctx.get_state(ast.ValueStateDescriptor("page", ttl=session_ttl))
        self.pages = ctx.get_list_state(ast.ListStateDescriptor("pages", ttl=session_ttl))

    async def process_element(self, value, ctx):
        user, page = value
        if page is not None:
            await self.page.update(page)
            await self.pages.add(page)
            return
        last = await self.page.value()  # refreshes the session, unless it has expired
        visited = await (await self.pages.get()).to_list()
        ctx.emit((user, last, visited))


async def main():
    clock = ast.ManualClock(0)
    op = ast.KeyedOperator(Sessions(), key_selector=lambda r: r[0],
                           backend=ast.HeapBackend(), clock=clock)
    async with op:
        for minute, record in [(0, ("ann", "/home")), (5, ("bob", "/docs")),
                               (20, ("ann", "/about")), (40, ("ann", None)),
                               (40, ("bob", None)), (65, ("ann", None)),
                               (100, ("ann", None))]:
            await op.advance_processing_time(minute * MINUTE)
            await op.process(record)
            await op.drain()
            for user, last, visited in op.outputs():
                print(f"minute {minute}: {user} last saw {last}, pages {visited}")


asyncio.run(main())
