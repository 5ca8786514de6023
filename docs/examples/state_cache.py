"""A state cache in front of a simulated remote store: reads of hot keys are answered
without a remote call, writes complete at once and reach the store in order, and the
results are exactly the uncached store's."""

import asyncstate as ast


class WordCount(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, word, ctx):
        def emit(n):
            ctx.emit((word, n))
            return self.count.update(n)

        return self.count.value().then_apply(lambda n: (n or 0) + 1).then_compose(emit)


words = ("the cat and the dog and the bird saw the cat " * 50).split()
plain = ast.run(WordCount(), words, key_selector=lambda w: w,
                backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1))
backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1, cache_entries=100)
cached = ast.run(WordCount(), words, key_selector=lambda w: w, backend=backend)

print("same results:", sorted(cached) == sorted(plain))
print("final counts:", sorted(max(n for w2, n in cached if w2 == w) for w in set(words)))
cache = backend.state_cache
print("reads answered by the cache:", cache.hits, "of", cache.hits + cache.misses)
print("remote calls with the cache:", backend.calls, "<", len(words))
