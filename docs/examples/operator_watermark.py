"""Drive a KeyedOperator from async code: process records, advance the watermark, collect
outputs and read the operator's metrics."""

import asyncio

import asyncstate as ast


class RunningTotal(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.total = ctx.get_reducing_state(
            ast.ReducingStateDescriptor("total", lambda a, b: a + b))

    async def process_element(self, value, ctx):
        _, amount, _ = value
        await self.total.add(amount)
        ctx.emit((ctx.current_key, ctx.timestamp, await self.total.get()))


async def main():
    operator = ast.KeyedOperator(
        RunningTotal(),
        key_selector=lambda r: r[0],
        timestamp_selector=lambda r: r[2],  # event time in ms
        backend=ast.HeapBackend(),
    )
    async with operator:
        for record in [("eu", 5, 1000), ("us", 7, 1200), ("eu", 1, 1500)]:
            await operator.process(record)  # returns once admitted, not once processed
        # Returns after every earlier record has finished.
        await operator.advance_watermark(2000)
        print("watermark", operator.current_watermark())
        print("first batch:", sorted(operator.outputs()))

        for record in [("us", 3, 2500), ("eu", 2, 2600)]:
            await operator.process(record)
        await operator.advance_watermark(3000)
        print("second batch:", sorted(operator.outputs()))
        print("outputs() clears:", operator.outputs())

        metrics = operator.metrics
        for name in ("records_in", "records_done", "in_flight", "requests"):
            print(f"{name}: {metrics[name]}")


asyncio.run(main())
