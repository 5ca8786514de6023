"""Sessions with event-time timers: a user's clicks are counted until the user has been idle
for 30 minutes; then one line per session is emitted. The clicks arrive in time order, so
the watermark moves to each click's time before the click is processed."""

import asyncio

import asyncstate as ast

GAP = 30 * 60 * 1000  # 30 minutes, in milliseconds


class Sessions(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.clicks = ctx.get_state(ast.ValueStateDescriptor("clicks"))
        self.start = ctx.get_state(ast.ValueStateDescriptor("start"))
        self.last = ctx.get_state(ast.ValueStateDescriptor("last"))

    async def process_element(self, click, ctx):
        previous = await self.last.value()
        if previous is None:
            await self.start.update(ctx.timestamp)
        else:
            ctx.timer_service.delete_event_time_timer(previous + GAP)
        await self.last.update(ctx.timestamp)
        await self.clicks.update((await self.clicks.value() or 0) + 1)
        ctx.timer_service.register_event_time_timer(ctx.timestamp + GAP)

    async def on_timer(self, timestamp, ctx):
        start, clicks = await self.start.value(), await self.clicks.value()
        minutes = (timestamp - GAP - start) // 60_000
        ctx.emit(f"{ctx.current_key}: {clicks} click{'s' * (clicks > 1)} in {minutes} min, "
                 f"closed at {timestamp // 60_000} min")
        for state in (self.clicks, self.start, self.last):
            await state.clear()


async def main():
    clicks = [("ann", 0), ("bob", 1), ("ann", 10), ("ann", 25), ("bob", 70), ("ann", 90)]
    async with ast.KeyedOperator(Sessions(), key_selector=lambda c: c[0],
                                 timestamp_selector=lambda c: c[1] * 60_000,
                                 backend=ast.HeapBackend()) as op:
        for click in clicks:
            await op.advance_watermark(click[1] * 60_000)  # fires the sessions it closes
            for line in op.outputs():
                print(f"at {click[1]} min  {line}")
            await op.process(click)
        await op.advance_watermark(2**63 - 1)  # the end: the open sessions close
        for line in op.outputs():
            print(f"at the end  {line}")


asyncio.run(main())
