"""Rescale a job between runs: count clicks per user at parallelism 2, checkpoint, then go on
at parallelism 3 from that checkpoint. Each run routes every record to the operator that
owns its key's key group."""

import tempfile

import asyncstate as ast


class Clicks(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, user, ctx):
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((user, n))


monday = ["ann", "bob", "ann", "cid", "dan", "ann"]
tuesday = ["bob", "ann", "eve", "dan"]

with tempfile.TemporaryDirectory() as checkpoints:
    ast.run(Clicks, monday, key_selector=lambda user: user, parallelism=2,
            checkpoint_dir=checkpoints, checkpoint_id=1)
    out = ast.run(Clicks, tuesday, key_selector=lambda user: user, parallelism=3,
                  restore_from=ast.checkpoint_path(checkpoints, 1),
                  checkpoint_dir=checkpoints, checkpoint_id=2)

for user, n in sorted(out):
    owner = ast.operator_index_for_key(user, 128, 3)
    print(f"{user}: click {n} (operator {owner} of 3)")
