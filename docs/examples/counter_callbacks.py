"""The same counter in callback style: a plain `def` returning a StateFuture chain."""

import asyncstate as ast


class Counter(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value, ctx):
        def store(current):
            n = (current or 0) + 1
            # then_compose: the callback returns a StateFuture, whose result flows on.
            return self.count.update(n).then_apply(lambda _: n)

        # Return the chain: the record finishes when it does, and a failure anywhere in it
        # fails the run.
        return (
            self.count.value()
            .then_compose(store)
            .then_accept(lambda n: ctx.emit((ctx.current_key, n)))
        )


records = ["x", "y", "x", "x", "y"]
out = ast.run(Counter(), records, key_selector=lambda r: r)
print(sorted(out))

# Completed futures and their combinators work without an event loop.
fut = ast.completed_future(20).then_apply(lambda v: v + 1)
print(fut.done(), fut.result())
both = ast.combine_all([ast.completed_future("a"), ast.completed_future("b")])
print(both.result())
