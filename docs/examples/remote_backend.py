"""A backend behind a simulated network round trip: requests of many keys travel together
in batches, and the results are exactly the inner backend's."""

import asyncio

import asyncstate as ast


class WordCount(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value, ctx):
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, n))


async def main():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1)
    config = ast.AsyncStateConfig(batch_size=8)
    operator = ast.KeyedOperator(WordCount(), key_selector=lambda w: w, backend=backend,
                                 config=config)
    words = ["the", "cat", "and", "the", "dog", "and", "the", "bird", "saw", "the", "cat"]
    async with operator:
        for word in words:
            await operator.process(word)
        await operator.drain()
        metrics = operator.metrics
        final = {}
        for key, n in operator.outputs():
            final[key] = max(n, final.get(key, 0))

    print("counts:", sorted(final.items()))
    print("batched:", metrics["batches"] > 0)
    print("requests:", metrics["requests"])
    print("batches never exceed batch_size:", 0 < metrics["max_batch_size"] <= config.batch_size)
    print("latency was slept:", backend.measured_latency_ms() > 0)


asyncio.run(main())
