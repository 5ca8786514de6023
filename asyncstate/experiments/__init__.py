"""Back-pressure and disaggregated-state experiments (`asyncstate experiment backpressure`).

A keyed job runs against `SimulatedRemoteBackend` (a heap or RocksDB store behind a simulated
network round trip) while one knob at a time sweeps over its values; every run is bounded in
time and reports throughput, per-record latency percentiles, in-flight records, back-pressure,
batch sizes, cache hit rate, the Little's-law throughput bound and a self-check of the
measurements. The parts, one concept each:

- `keys`: key streams (uniform, Zipf) and the share of the hottest key;
- `workloads`: the keyed functions (counter, list append, map update) that time their records;
- `arms`: what is compared (synchronous baseline, asyncstate, asyncstate + cache, on the heap
  or on RocksDB) and the bounds each arm is held to;
- `driver`: one run, closed or open loop, and its figures;
- `sweep`: the grid of runs and running it;
- `report`: the table, CSV and JSON; `plots`: the PNG figures (matplotlib).

`scripts/bench.py latency`, `skew` and `backpressure` use the same parts.
"""

__all__: list[str] = []
