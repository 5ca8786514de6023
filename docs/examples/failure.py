"""An exception raised by user code fails the run and propagates out of `ast.run`."""

import asyncstate as ast


class Validate(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.total = ctx.get_state(ast.ValueStateDescriptor("total"))

    async def process_element(self, value, ctx):
        if value["amount"] < 0:
            raise ValueError(f"negative amount {value['amount']} for {ctx.current_key!r}")
        total = (await self.total.value() or 0) + value["amount"]
        await self.total.update(total)
        ctx.emit((ctx.current_key, total))


records = [
    {"account": "a", "amount": 10},
    {"account": "b", "amount": 5},
    {"account": "a", "amount": -3},
    {"account": "b", "amount": 1},
]
try:
    ast.run(Validate(), records, key_selector=lambda r: r["account"])
except ValueError as exc:
    print(f"{type(exc).__name__}: {exc}")

# A value msgpack cannot encode is rejected at the call that writes it.


class StoreObject(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.last = ctx.get_state(ast.ValueStateDescriptor("last"))

    async def process_element(self, value, ctx):
        await self.last.update(object())


try:
    ast.run(StoreObject(), ["x"], key_selector=lambda r: r)
except ast.SerializationError as exc:
    print(f"{type(exc).__name__} (state {exc.state_name!r}, type {exc.type_name!r})")

# Invalid configuration raises at construction; ConfigError is also a ValueError.
try:
    ast.AsyncStateConfig(batch_size=0)
except ValueError as exc:
    print(f"{type(exc).__name__}: {exc}")
