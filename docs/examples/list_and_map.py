"""ListState, MapState and StateIterator: `on_next` in callback style, `async for` in async
code."""

import asyncstate as ast


class Sessions(ast.KeyedProcessFunction):
    """Per user: the pages visited in order (ListState) and visits per page (MapState)."""

    def open(self, ctx):
        self.visits = ctx.get_list_state(ast.ListStateDescriptor("visits"))
        self.per_page = ctx.get_map_state(ast.MapStateDescriptor("per_page"))

    async def process_element(self, value, ctx):
        user, action, page = value
        if action == "visit":
            await self.visits.add(page)
            seen = await self.per_page.get(page)
            await self.per_page.put(page, (seen or 0) + 1)
        elif action == "forget":
            # put(k, None) removes the entry, like remove(k).
            await self.per_page.put(page, None)
        elif action == "report":
            it = await self.visits.get()
            if it.is_empty():
                ctx.emit((user, "no visits"))
                return
            everything = await it.to_list()
            # on_next: fn runs on every item in order; non-None results are collected.
            upper = await it.on_next(lambda p: p.upper() if p != "/home" else None)
            entries = await self.per_page.entries()
            counts = {}
            async for page_name, count in entries:  # items are (key, value) tuples
                counts[page_name] = count
            has_about = await self.per_page.contains("/about")
            ctx.emit((user, everything, upper, sorted(counts.items()), has_about))


records = [
    ("ann", "visit", "/home"),
    ("bob", "visit", "/docs"),
    ("ann", "visit", "/about"),
    ("ann", "visit", "/home"),
    ("bob", "visit", "/docs"),
    ("ann", "forget", "/about"),
    ("ann", "report", None),
    ("bob", "report", None),
    ("eve", "report", None),
]
# A chunk size of 2 makes longer lists load in several steps; iteration looks the same.
config = ast.AsyncStateConfig(iterator_chunk_size=2)
out = ast.run(Sessions(), records, key_selector=lambda r: r[0], config=config)
for user, *report in sorted(out, key=lambda o: o[0]):
    if report == ["no visits"]:
        print(f"{user}: no visits")
        continue
    everything, upper, counts, has_about = report
    print(f"{user}: visits {everything}")
    print(f"  not /home, upper-cased: {upper}")
    print(f"  per page: {counts}; /about still counted: {has_about}")
