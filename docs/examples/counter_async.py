"""Count records per key with an `async def` function, run by `ast.run`."""

import asyncstate as ast


class Counter(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value, ctx):
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, value[1], n))


records = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("b", 5), ("a", 6)]
out = ast.run(Counter(), records, key_selector=lambda r: r[0])

# Records of one key are processed in arrival order; records of different keys may
# finish in any order, so sort before printing.
for key, value, n in sorted(out):
    print(f"{key}: value {value} is record number {n}")
